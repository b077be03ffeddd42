"""The cost model's efficiencies fitted to any objective: the coordinates the optimiser works in
and a deterministic Nelder-Mead. What is fitted against (published runs, `xlaopt calibrate`) is
the caller's; this module knows only `costmodel.Efficiency`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from xlaopt.analysis import costmodel as cm

# Start and bounds of the fit. Efficiencies live in (0, 1]; the optimiser works on unbounded
# coordinates mapped through a logistic (fractions) or an exponential (sizes).
FIT_START = cm.Efficiency(matmul_max=0.7, matmul_max_ampere=0.7, matmul_half_flops=1e10, attention=0.5,
                          attention_flash2=0.5, nvlink=0.7, network=0.7)
# The published rows cannot tell NVLink from network efficiency apart (only R13 and R21 leave
# network traffic exposed, and both also vary the matmul efficiencies): fitted separately they
# trade off freely and the leave-one-out error grows. So one `collective` value is fitted and
# used for both until rows that separate them exist.
_FRACTIONS = ("matmul_max", "matmul_max_ampere", "attention", "attention_flash2", "collective")
_SIZES = ("matmul_half_flops",)


def _to_theta(e: cm.Efficiency) -> np.ndarray:
    values = {**dataclasses.asdict(e), "collective": e.nvlink}
    # A fit can end at a bound (the logistic rounds to exactly 1), and a refit starts there. Where
    # the logistic is flat the simplex's first steps would not change the objective, and it would
    # stop at once: a start is kept inside [0.001, 0.999].
    fraction = {k: min(max(values[k], 1e-3), 1 - 1e-3) for k in _FRACTIONS}
    return np.array([math.log(fraction[k] / (1 - fraction[k])) for k in _FRACTIONS]
                    + [math.log(values[k]) for k in _SIZES])


def _from_theta(t: np.ndarray) -> cm.Efficiency:
    n = len(_FRACTIONS)
    values = {k: float(1 / (1 + math.exp(-x))) for k, x in zip(_FRACTIONS, t[:n])}
    values |= {k: float(math.exp(x)) for k, x in zip(_SIZES, t[n:])}
    collective = values.pop("collective")
    return cm.Efficiency(nvlink=collective, network=collective, **values)


def nelder_mead(f, x0: np.ndarray, step: float = 0.5, iterations: int = 300, tolerance: float = 1e-9) -> np.ndarray:
    """Minimise f from x0: the textbook simplex (reflect, expand, contract, shrink), stopped when
    the simplex's values agree to `tolerance`; deterministic."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


# Restarts of the simplex at most, after the first descent (see `minimise`).
MAX_RESTARTS = 20


def minimise(objective: Callable[[cm.Efficiency], float], start: cm.Efficiency = FIT_START,
             tolerance: float = 1e-9, restarts: int = MAX_RESTARTS) -> cm.Efficiency:
    """The efficiencies minimising `objective`. An objective with kinks (an absolute value per
    row) stalls a simplex on a kink: restart from the best point with a fresh, smaller simplex
    until a restart gains less than `tolerance`, at most `restarts` times (one restart left the
    published runs' fit at mean |log| 0.0375 where further restarts reach 0.0267)."""
    f = lambda t: objective(_from_theta(t))
    best = nelder_mead(f, _to_theta(start), tolerance=tolerance)
    value = f(best)
    for _ in range(restarts):
        point = nelder_mead(f, best, step=0.1, tolerance=tolerance)
        previous, value_at_point = value, f(point)
        if value_at_point >= previous:
            break
        best, value = point, value_at_point
        if previous - value < tolerance:
            break
    return _from_theta(best)

"""`xlaopt calibrate`: predict published training runs with the cost model, fit its few
efficiencies, and report the error per row and left out of the fit.

The CSV schema is ../shared/calibration/README.md (one row per published run: machine, decoder
shape, batch, parallel degrees, recomputation, precision, and the measured `step_time_s` or
`tokens_per_s_per_gpu`). Two methods price a row:

- "analytic" (the default; seconds for all rows): `xlaopt.analysis.analytic.price_step`, which also
  prices what xlaopt does not build (pipeline bubble and stage sends, context-parallel rings).
- "compiled": xlaopt's generic decoder at the row's full size compiled on a mesh of the row's
  degrees and its HLO priced by the schedule simulator with the same efficiencies: for the CPU
  (`xlaopt.analysis.calibrate_compiled`: data / FSDP / tensor parallel, at most 512 devices) or,
  with `target="gpu"`, deviceless for the row's GPUs (`xlaopt.analysis.calibrate_gpu`). Rows it
  cannot take fall back to "analytic" with the reason.

Each method is fitted and left out on its own prices (`fit`'s `price`): the compiled method
re-simulates its rows' kept schedules under each trial of the efficiencies (`compiled_price`).

Rows that cannot be modelled (unknown GPU, unstated vocabulary, parallel degrees that do not
multiply to the GPU count, ...) come back with method "unmodelled" and the reason, never dropped.

A row's schedule (`micro_batch`, `virtual_stages`) is read from its own optional columns; where a
column is absent or empty the documented default in `SCHEDULE_DEFAULTS` applies, and the row's
report lists the facts that were defaulted. Nothing is looked up by a row's other values: two runs
of the same model, GPU count and batch may run different schedules. How each framework runs
(fused kernels, overlap, reduction dtypes, attention kernel) is in `frameworks.FRAMEWORKS`;
everything else unstated is assumed as documented there.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
from typing import Callable

import numpy as np

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.analytic import DecoderShape, Parallelism, Software, price_step
from xlaopt.analysis.efficiency_fit import FIT_START, MAX_RESTARTS, minimise
from xlaopt.analysis.frameworks import RECOMPUTE_DEFAULT, software_for
from xlaopt.analysis.topology import Topology, TopologyError, preset
from xlaopt.errors import UserError

REQUIRED_COLUMNS = ("id", "framework", "gpu", "num_gpus", "gpus_per_node", "model", "layers", "d_model", "heads",
                    "kv_heads", "ffn", "vocab", "seq_len", "global_batch", "dp", "fsdp", "tp", "pp", "cp",
                    "act_ckpt", "precision", "metric", "value")
# Columns that must hold a value on every row; the others may be empty ("not stated").
REQUIRED_VALUES = ("id", "framework", "gpu", "num_gpus", "gpus_per_node", "layers", "d_model", "heads", "ffn",
                   "seq_len", "global_batch", "dp", "fsdp", "tp", "pp", "cp", "precision", "metric", "value")
METRICS = ("step_time_s", "tokens_per_s_per_gpu")
METHODS = ("analytic", "compiled")
TARGETS = ("cpu", "gpu")  # what the compiled method compiles for

# Schedule facts a row may state in optional columns, and what is assumed when it does not:
# one sequence per micro-batch (the smallest, as Megatron-style pipelines run; the most
# micro-batches, so FSDP's per-micro-batch gathers are never under-counted) and no interleaved
# pipeline chunks (the plain 1F1B schedule). The defaults never depend on the row's other values.
SCHEDULE_DEFAULTS = {"micro_batch": 1, "virtual_stages": 1}

# Vocabulary when a row leaves it empty, for models whose vocabulary is published elsewhere.
_KNOWN_VOCAB = {"GPT-3": 50257}  # GPT-2 BPE, Brown et al. 2020


@dataclasses.dataclass(frozen=True)
class Run:
    """One CSV row, parsed."""
    id: str
    framework: str
    gpu: str
    num_gpus: int
    gpus_per_node: int
    model: str
    shape: DecoderShape | None  # None when the row cannot be modelled (see `unmodelled`)
    layout: Parallelism
    act_ckpt: str
    precision: str
    metric: str
    measured: float
    unmodelled: str = ""  # why, when the row cannot be priced
    schedule_defaulted: tuple[str, ...] = ()  # schedule columns not stated, priced at SCHEDULE_DEFAULTS

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch * self.layout.seq_len


# Published training runs shipped with the package, the `source` column naming each row's origin:
# a copy of the shared calibration set (../shared/calibration/published_runs.csv; its README gives
# the columns' meaning and each row's caveats), which the project may extend with rows of its own.
PUBLISHED_RUNS = pathlib.Path(__file__).with_name("published_runs.csv")
# Published runs the efficiencies were never fitted on, from other sources (Megatron-LM's README,
# NeMo's and Megatron-Bridge's performance summaries; each row's `source` says where): what tests
# the frozen model, as ../shared/calibration/README.md asks. Priced with the frozen efficiencies,
# so every error is out of sample and there is no leave-one-out.
HELDOUT_RUNS = pathlib.Path(__file__).with_name("heldout_runs.csv")
RUN_SETS = {"published": PUBLISHED_RUNS, "heldout": HELDOUT_RUNS}


def read_runs(path: str | pathlib.Path = PUBLISHED_RUNS) -> list[Run]:
    """Parse the CSV; a missing column or an empty required field raises UserError naming it."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserError(f"calibration runs {path}: no such file")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = reader.fieldnames or []
        missing = [c for c in REQUIRED_COLUMNS if c not in columns]
        if missing:
            raise UserError(f"{path}: missing column(s) {', '.join(missing)}; the schema is in "
                            f"../shared/calibration/README.md")
        runs = [_parse_row(row, line, path) for line, row in enumerate(reader, start=2)]
    if not runs:
        raise UserError(f"{path}: no rows")
    return runs


def _parse_row(row: dict, line: int, path: pathlib.Path) -> Run:
    where = f"{path}: row {row.get('id') or '?'} (line {line})"
    for col in REQUIRED_VALUES:
        if not (row.get(col) or "").strip():
            raise UserError(f"{where}: empty required field {col!r}")

    def num(col: str, cast=int):
        text = row[col].strip()
        try:
            value = cast(text)
        except ValueError:
            raise UserError(f"{where}: column {col!r} must be a number, not {text!r}") from None
        if cast is int and value < 0 or cast is float and not value > 0:
            raise UserError(f"{where}: column {col!r} must be positive, not {text!r}")
        return value

    metric = row["metric"].strip()
    if metric not in METRICS:
        raise UserError(f"{where}: metric {metric!r}; use one of {METRICS}")
    schedule, defaulted = {}, []
    for col, default in SCHEDULE_DEFAULTS.items():
        if (row.get(col) or "").strip():  # absent column (None) or empty cell: not stated
            schedule[col] = num(col)
            if schedule[col] < 1:
                raise UserError(f"{where}: column {col!r} must be at least 1, not {row[col].strip()!r}")
        else:
            schedule[col] = default
            if col != "virtual_stages" or num("pp") > 1:  # interleaving means nothing without a pipeline
                defaulted.append(col)
    layout = Parallelism(dp=num("dp"), fsdp=num("fsdp"), tp=max(num("tp"), 1), pp=max(num("pp"), 1),
                    cp=max(num("cp"), 1), global_batch=num("global_batch"), seq_len=num("seq_len"), **schedule)
    if layout.num_devices != num("num_gpus"):  # a typo in a degree: refused, not priced as another run
        raise UserError(f"{where}: columns dp x fsdp x tp x pp x cp = {layout.num_devices} is not num_gpus = "
                        f"{num('num_gpus')}; fix the parallel degrees or num_gpus")
    model = row["model"].strip()
    shape, why = _shape(row, model, num)
    if not why and layout.micro_batches < 1:
        why = (f"global_batch {layout.global_batch} is smaller than one micro-batch of {layout.micro_batch} "
               f"per data rank ({layout.data} data ranks)")
    if not why and layout.virtual_stages > 1 and layout.pp <= 1:
        why = f"virtual_stages {layout.virtual_stages} without pipeline stages (pp = {layout.pp})"
    return Run(id=row["id"].strip(), framework=row["framework"].strip(), gpu=row["gpu"].strip(),
               num_gpus=num("num_gpus"), gpus_per_node=num("gpus_per_node"), model=model, shape=shape,
               layout=layout, act_ckpt=row["act_ckpt"].strip(), precision=row["precision"].strip(),
               metric=metric, measured=num("value", float), unmodelled=why,
               schedule_defaulted=tuple(defaulted))


def _shape(row: dict, model: str, num) -> tuple[DecoderShape | None, str]:
    vocab_text = row["vocab"].strip()
    if vocab_text:
        vocab = num("vocab")
    else:
        vocab = next((v for name, v in _KNOWN_VOCAB.items() if model.startswith(name)), None)
        if vocab is None:
            return None, "vocab not stated and not known for this model"
    # GPT and MPT rows: plain GELU MLP, head tied to the embedding; Nemotron-4: a plain MLP too
    # (squared ReLU: the same two matrices), untied; Llama and every other family: SwiGLU, untied
    # (the common modern decoder).
    tied = any(family in model.lower() for family in ("gpt", "mpt"))
    gelu = tied or "nemotron" in model.lower()
    heads = num("heads")
    kv_heads = num("kv_heads") if row["kv_heads"].strip() else heads  # not stated: multi-head attention
    dims = dict(layers=num("layers"), d_model=num("d_model"), heads=heads, kv_heads=kv_heads, ffn=num("ffn"),
                vocab=vocab, mlp="gelu" if gelu else "swiglu", tied_embeddings=tied)
    try:
        return DecoderShape(**dims), ""
    except ValueError as e:
        return None, f"bad shape: {e}"


# --- from a row to a priced step ----------------------------------------------------------------

def topology_for(run: Run) -> Topology | None:
    """The preset the gpu column names, shaped nodes x gpus_per_node."""
    gpu = run.gpu.lower()
    if "h100" in gpu and ("96gb" in gpu or "500w" in gpu):
        name = "h100gt"  # H100 96 GB HBM2e at 500 W (TorchTitan's Grand Teton); see topology.py
    else:  # gb200 before b200, which it contains
        name = next((n for n in ("gb200", "b200", "h100", "h200", "a100") if n in gpu), None)
    if name is None:
        return None
    return preset(name, math.ceil(run.num_gpus / run.gpus_per_node), run.gpus_per_node)


@dataclasses.dataclass(frozen=True)
class Priced:
    """A modelled row with everything `predict` needs."""
    run: Run
    topology: Topology
    software: Software


def prepare(run: Run) -> Priced | str:
    if run.unmodelled:
        return run.unmodelled
    try:
        topology = topology_for(run)
    except TopologyError as e:  # e.g. more GPUs per node than the preset's domain holds
        return str(e)
    if topology is None:
        return f"no topology preset for gpu {run.gpu!r}"
    software = software_for(run)
    if isinstance(software, str):
        return software
    if software.fp8_linear and not topology.device.has_fp8:
        return f"{topology.device.name} has no fp8 peak"
    return Priced(run, topology, software)


def predict(p: Priced, eff: cm.Efficiency) -> float:
    """The row's metric as the cost model predicts it."""
    return metric_of(p.run, price_step(p.run.shape, p.run.layout, p.topology, p.software, eff).step_time_s)


def metric_of(run: Run, step_s: float) -> float:
    """The row's metric for a step of `step_s` seconds."""
    return step_s if run.metric == "step_time_s" else run.tokens_per_step / step_s / run.num_gpus


# --- fitting ------------------------------------------------------------------------------------

def objective(priced: list[Priced], eff: cm.Efficiency, price: Callable = predict) -> float:
    """Mean |log(predicted / measured)|: symmetric in over- and under-prediction. `price(p, eff)`:
    the row's metric as the method predicts it (the analytic model's by default)."""
    return float(np.mean([abs(math.log(price(p, eff) / p.run.measured)) for p in priced]))


def fit(priced: list[Priced], start: cm.Efficiency = FIT_START, price: Callable = predict,
        tolerance: float = 1e-9, restarts: int = MAX_RESTARTS) -> cm.Efficiency:
    """The efficiencies minimising `objective` on `priced`; a few seconds for 11 rows priced
    analytically."""
    return minimise(lambda eff: objective(priced, eff, price), start, tolerance, restarts)


# The compiled method's fits stop when the simplex's values agree to this (mean |log| ~0.1-0.3):
# each of its objective values simulates every compiled row (up to a second for a pipeline's
# 350,000 ops), and the analytic fit's 1e-9 takes ~1,000 of them where this takes ~200. For the
# same reason they restart the simplex once, not until a restart gains nothing: each descent
# simulates the compiled rows some 300 times, about 10 minutes on the dev VM.
COMPILED_TOLERANCE = 1e-4
COMPILED_RESTARTS = 1


def compiled_price(steps: dict) -> Callable:
    """`price(p, eff)` of the compiled method: a compiled row from its kept schedule, simulated
    under `eff`; a row not compiled analytically, as the report prices it."""
    def price(p: Priced, eff: cm.Efficiency) -> float:
        step = steps.get(p.run.id)
        if step is None or isinstance(step, str):
            return predict(p, eff)
        return metric_of(p.run, step.price(eff)["step_time_s"])
    return price


def fitting(method: str, steps: dict) -> tuple[Callable, cm.Efficiency, float, int]:
    """(price, start, tolerance, restarts) of `method`'s fit on every row: the analytic model's from
    FIT_START to 1e-9; the compiled method's on its prices (`steps`) from FITTED to
    `COMPILED_TOLERANCE`, restarted `COMPILED_RESTARTS` times."""
    if method == "compiled":
        return compiled_price(steps), cm.FITTED, COMPILED_TOLERANCE, COMPILED_RESTARTS
    return predict, FIT_START, 1e-9, MAX_RESTARTS


def refit(runs: list[Run], method: str = "analytic", target: str = "cpu", log=None) -> dict:
    """`xlaopt calibrate --runs CSV --fit`: `fit` on every modelled row, as `costmodel.FITTED` was
    frozen (analytic: from `FIT_START`; compiled: the rows compiled for `target` and the fit run
    from FITTED to `COMPILED_TOLERANCE`); the values to 3 significant figures (what FITTED holds),
    the objective at both, and the literal (the analytic one to paste as FITTED). Nothing in the
    code changes."""
    priced = [p for p in (prepare(run) for run in runs) if isinstance(p, Priced)]
    if not priced:
        raise UserError("no modelled rows to fit")
    price, start, tolerance, restarts = fitting(method, _compiled_steps(priced, method, target, log))
    fitted = fit(priced, start, price, tolerance, restarts)
    rounded = cm.Efficiency(**{k: float(f"{v:.3g}") for k, v in dataclasses.asdict(fitted).items()})
    literal = "Efficiency(" + ", ".join(f"{k}={v:.3g}" for k, v in dataclasses.asdict(rounded).items()) + ")"
    literal = f"FITTED = {literal}" if method == "analytic" else f"{literal}  # the compiled method's fit, not FITTED"
    return dict(rows=[p.run.id for p in priced], method=method, fitted=dataclasses.asdict(fitted),
                rounded=dataclasses.asdict(rounded), frozen=dataclasses.asdict(cm.FITTED),
                objective_fitted=objective(priced, fitted, price),
                objective_frozen=objective(priced, cm.FITTED, price), literal=literal)


def _compiled_steps(priced: list[Priced], method: str, target: str, log=None, attention: str = "kernel") -> dict:
    """Row id -> its compiled step or why not (`compile_rows`, `calibrate_gpu.compile_rows`); {}
    for the analytic method."""
    if method != "compiled":
        return {}
    if target == "gpu":
        from xlaopt.analysis.calibrate_gpu import compile_rows as compile_gpu_rows

        return compile_gpu_rows(priced, log)
    return compile_rows(priced, attention, log)


# --- the report ---------------------------------------------------------------------------------

def calibrate(runs: list[Run], eff: cm.Efficiency = cm.FITTED, leave_one_out: bool = True,
              method: str = "analytic", attention: str = "kernel", log=None, target: str = "cpu") -> dict:
    """Per-row predictions with `eff`, summary errors, and leave-one-out figures (refit without
    each modelled row, predict it). `method` "compiled" compiles the rows it can for `target`
    (see the module docstring; `attention` as in `xlaopt.analysis.calibrate_compiled`, the CPU
    target's) and prices the rest analytically; `log(message)` hears about each compilation."""
    if method not in METHODS:
        raise UserError(f"calibration method {method!r}; use one of {', '.join(METHODS)}")
    if target not in TARGETS:
        raise UserError(f"calibration target {target!r}; use one of {', '.join(TARGETS)}")
    prepared = [(run, prepare(run)) for run in runs]
    priced = [p for _, p in prepared if isinstance(p, Priced)]
    steps = _compiled_steps(priced, method, target, log, attention)
    rows = []
    for run, p in prepared:
        # Which schedule facts the row did not state (priced at SCHEDULE_DEFAULTS), on every row;
        # the recomputation too where act_ckpt is empty.
        defaults = {"schedule_defaults": {c: SCHEDULE_DEFAULTS[c] for c in run.schedule_defaulted}}
        if not run.act_ckpt:
            defaults["act_ckpt_default"] = RECOMPUTE_DEFAULT
        if isinstance(p, str):
            rows.append(dict(id=run.id, predicted=None, measured=run.measured, rel_error=None,
                             method="unmodelled", metric=run.metric, reason=p, **defaults))
            continue
        step = steps.get(run.id)
        if step is None or isinstance(step, str):
            predicted = predict(p, eff)
            rows.append(dict(id=run.id, predicted=predicted, measured=run.measured,
                             rel_error=predicted / run.measured - 1, method="analytic", metric=run.metric,
                             recompute=p.software.recompute, **({"reason": step} if step else {}), **defaults))
            continue
        priced_step = step.price(eff)
        predicted = metric_of(run, priced_step["step_time_s"])
        rows.append(dict(id=run.id, predicted=predicted, measured=run.measured, rel_error=predicted / run.measured - 1,
                         method="compiled", metric=run.metric, recompute=p.software.recompute,
                         analytic_predicted=predict(p, eff),
                         mesh=str(step.mesh), attention=step.attention, compile_s=step.timings_s,
                         breakdown=priced_step, approximations=step.approximations, **defaults))
    errors = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    result = dict(method=method, target=target if method == "compiled" else None, efficiency=dataclasses.asdict(eff),
                  rows=rows,
                  median_abs_rel_error=float(np.median(errors)) if errors else None,
                  max_abs_rel_error=float(np.max(errors)) if errors else None,
                  modelled=len(priced), unmodelled=len(runs) - len(priced),
                  compiled=sum(r["method"] == "compiled" for r in rows))
    compiled_errors = [abs(r["rel_error"]) for r in rows if r["method"] == "compiled"]
    if compiled_errors:
        result.update(compiled_median_abs_rel_error=float(np.median(compiled_errors)),
                      compiled_max_abs_rel_error=float(np.max(compiled_errors)))
    if leave_one_out and len(priced) > 1:
        # Each method refits on its own prices. The compiled method's fits are simulations (see
        # COMPILED_TOLERANCE): its all-rows fit runs from FITTED, and each refit without a row
        # starts a fresh simplex (the fit's full first step) at the all-rows fit.
        price, start, tolerance, restarts = fitting(method, steps)
        if method == "compiled":
            start = fit(priced, start, price, tolerance, restarts)
            result["compiled_fit"] = dict(efficiency=dataclasses.asdict(start),
                                          objective=objective(priced, start, price),
                                          objective_frozen=objective(priced, eff, price))
        loo = {}
        for i, p in enumerate(priced):
            refit = fit(priced[:i] + priced[i + 1:], start, price, tolerance, restarts)
            loo[p.run.id] = price(p, refit) / p.run.measured - 1
        for r in rows:
            r["loo_rel_error"] = loo.get(r["id"])
        loo_abs = [abs(v) for v in loo.values()]
        result.update(loo_median_abs_rel_error=float(np.median(loo_abs)), loo_max_abs_rel_error=float(np.max(loo_abs)))
    return result


def compile_rows(priced: list[Priced], attention: str = "kernel", log=None) -> dict:
    """Row id -> its `CompiledStep`, or why it was not compiled. Asks for the simulated CPU
    devices the largest compilable row needs first (possible only before JAX starts its backends;
    a row needing more than the process has then says so)."""
    from xlaopt.analysis import calibrate_compiled as cc
    from xlaopt.mesh import request_cpu_devices

    blockers = {p.run.id: cc.compile_blocker(p) for p in priced}
    needed = [p.run.layout.num_devices for p in priced if not blockers[p.run.id]]
    if needed:
        request_cpu_devices(max(needed))
    steps = {}
    for p in priced:
        if blockers[p.run.id]:
            steps[p.run.id] = blockers[p.run.id]
            continue
        if log is not None:
            log(f"compiling {p.run.id} ({p.run.model}, mesh {cc.mesh_for(p.run.layout)}) ...")
        steps[p.run.id] = cc.compile_step(p, attention)
    return steps


def main_calibrate(runs_path: str | pathlib.Path = PUBLISHED_RUNS, json_out: str | pathlib.Path | None = None,
                   method: str = "analytic", refit_only: bool = False, target: str = "cpu") -> dict:
    """`xlaopt calibrate [--runs CSV|published|heldout] [--method analytic|compiled] [--json OUT]`:
    the report with the frozen efficiencies (on the packaged published runs by default; the
    held-out set without leave-one-out, none of it being fitted on); with `refit_only` (`--fit`),
    `refit` instead."""
    import sys

    log = lambda message: print(message, file=sys.stderr, flush=True)
    runs_path = RUN_SETS.get(str(runs_path), runs_path)
    held_out = pathlib.Path(runs_path) == HELDOUT_RUNS
    result = (refit(read_runs(runs_path), method, target, log) if refit_only
              else calibrate(read_runs(runs_path), method=method, log=log, target=target, leave_one_out=not held_out))
    result["runs"] = str(runs_path)
    if json_out is not None:
        pathlib.Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result

"""The fit's optimiser on objectives whose minimum is known."""
import dataclasses

import pytest

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.efficiency_fit import FIT_START, minimise

TARGET = cm.Efficiency(matmul_max=0.61, matmul_max_ampere=0.79, matmul_half_flops=3e10, attention=0.35,
                       attention_flash2=0.17, nvlink=0.8, network=0.8)
FIELDS = ("matmul_max", "matmul_max_ampere", "attention", "attention_flash2", "nvlink")


def _kinked(eff: cm.Efficiency) -> float:
    # A sum of absolute values, like the calibration's mean |log ratio|: kinks at the minimum.
    return sum(abs(getattr(eff, k) - getattr(TARGET, k)) for k in FIELDS) + abs(
        eff.matmul_half_flops / TARGET.matmul_half_flops - 1)


def test_restarts_reach_a_kinked_objectives_minimum():
    fitted = minimise(_kinked, FIT_START)
    for name in (*FIELDS, "matmul_half_flops"):
        assert getattr(fitted, name) == pytest.approx(getattr(TARGET, name), rel=1e-3), name


def test_a_start_at_a_bound_is_a_start():
    # A compiled fit can end with a fraction at 1 (the logistic rounds to it); the leave-one-out
    # refits start there.
    at_bound = dataclasses.replace(TARGET, attention=1.0)
    fitted = minimise(_kinked, at_bound)
    assert fitted.attention == pytest.approx(TARGET.attention, rel=1e-3)

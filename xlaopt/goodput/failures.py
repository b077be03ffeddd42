"""How often a job fails: failures arrive at random (a Poisson process), each GPU contributing
its share, so a job of N GPUs fails N times as often as one GPU."""
from __future__ import annotations

import dataclasses
import math

from xlaopt.errors import UserError

HOUR_S = 3600.0
# Bounds on an MTBF per GPU: below 10 hours a GPU would fail every day or two, which no cluster
# trains on; above 1e8 hours (11,000 years) it is not a model of hardware.
MTBF_GPU_H_RANGE = (10.0, 1e8)


@dataclasses.dataclass(frozen=True)
class FailureModel:
    mtbf_gpu_h: float  # mean time between failures per GPU (its node's faults shared among its GPUs), hours
    source: str = "given"

    def job_mtbf_s(self, gpus: int) -> float:
        """The mean time between failures of a job on `gpus` GPUs."""
        return self.mtbf_gpu_h * HOUR_S / gpus


# Llama 3 405B's pre-training (Llama Team, "The Llama 3 Herd of Models", 2024, section 3.3.4): 466
# interruptions in a 54-day snapshot on 16,384 H100, 47 of them planned maintenance (which loses no
# work); the 419 unexpected ones, 78% of them hardware, are the failures.
LLAMA3 = FailureModel(54 * 24 * 16384 / 419, "Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 H100")
PRESETS = {"llama3": LLAMA3}


def failure_model(setting: str) -> FailureModel:
    """`--mtbf`: an MTBF per GPU in hours, or a preset's name."""
    if setting in PRESETS:
        return PRESETS[setting]
    try:
        hours = float(setting)
    except ValueError:
        raise UserError(f"--mtbf {setting!r}: give an MTBF per GPU in hours (Llama 3's cluster: about 50,700) or a "
                        f"preset: {', '.join(PRESETS)}") from None
    low, high = MTBF_GPU_H_RANGE
    if not (math.isfinite(hours) and low <= hours <= high):
        raise UserError(f"--mtbf {setting}: an MTBF per GPU must be between {low:g} and {high:g} hours (Llama 3's "
                        f"cluster: about {LLAMA3.mtbf_gpu_h:,.0f}); give hours per GPU, not per job")
    return FailureModel(hours)

"""The checkpoint interval that loses least, per tier, and the goodput it should give.

Between two checkpoints a job computes for τ seconds and then blocks for a save of δ. A failure
(mean time between them M) loses the work since the last checkpoint, half an interval on average,
and costs a restart R (the gap, start-up and restore). Young (1974) minimised the first-order
overhead δ/τ + τ/(2M): τ = √(2δM). Daly (2006, "A higher order estimate of the optimum checkpoint
interval for restart dumps") kept the higher orders of exponential failures:
τ = √(2δM)·(1 + √(δ/2M)/3 + (δ/2M)/9) − δ for δ < 2M, else τ = M, and gave the expected wall
time of T of work, T_w = M·e^(R/M)·(e^((τ+δ)/M) − 1)·T/τ, whose inverse ratio is the goodput.

Two tiers (a local save to node memory or disk, copied to a peer, and a rarer persistent one): a
failure restarts from the local tier unless it lost that too (a node and its peer gone together),
so the local interval is Daly's for every failure and the persistent one Daly's for the failures
that reach it; the persistent interval is a whole number of local ones.
"""
from __future__ import annotations

import dataclasses
import math

from xlaopt.errors import UserError
from xlaopt.goodput.costs import JobCosts
from xlaopt.goodput.failures import HOUR_S, FailureModel


def young_s(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def daly_s(save_s: float, mtbf_s: float) -> float:
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def daly_goodput(work_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's expected goodput of one tier: τ of work per checkpoint of δ, restarts of R."""
    return work_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((work_s + save_s) / mtbf_s))


@dataclasses.dataclass(frozen=True)
class Intervals:
    every: int  # steps between persistent saves
    local_every: int | None = None  # steps between local saves (a divisor of `every`), when two tiers

    def check(self, costs: JobCosts) -> None:
        """An interval must leave time to train: its steps take longer than its save."""
        tiers = [("--every", self.every, max(costs.save_s, costs.write_s))]
        if self.local_every is not None:
            tiers.append(("the local interval", self.local_every, costs.local_save_s))
            if self.every % self.local_every:
                raise UserError(f"--every {self.every}: the persistent interval must be a multiple of the local one, "
                                f"{self.local_every} steps (a persistent save replaces a local one)")
        each = costs.step_s + costs.step_overhead_s
        for flag, steps, save_s in tiers:
            if steps < 1 or steps * each <= save_s:
                raise UserError(f"{flag} {steps}: {steps} steps take {steps * each:.3g} s, not more than one "
                                f"save ({save_s:.3g} s, with its write); give at least {math.floor(save_s / each) + 1} "
                                f"steps")


def local_loss_probability(costs: JobCosts, local_every_s: float, mtbf_gpu_s: float, gpus_per_node: int,
                           peer_copy: bool) -> float:
    """The chance that a failure also takes the local copy it would restore from. Without a peer
    copy, every failure of a node (each failure here is one: the GPUs' share of node faults) loses
    that node's shard. With one, only the peer node's failing too before the restarted job has
    saved again loses it: within a restart and one local interval after it."""
    if not peer_copy:
        return 1.0
    window = costs.restart_s(local=True) + local_every_s
    return -math.expm1(-window * gpus_per_node / mtbf_gpu_s)


def plan_intervals(costs: JobCosts, failures: FailureModel, gpus: int, gpus_per_node: int = 8,
                   peer_copy: bool = True) -> tuple[Intervals, float]:
    """Each tier's interval in steps (Daly's for the failures that tier serves, at least one step and
    more than its save) and the chance a failure loses the local tier (1 with one tier)."""
    mtbf_s = failures.job_mtbf_s(gpus)

    each = costs.step_s + costs.step_overhead_s  # a step's wall time, its host work outside it included

    def steps(seconds: float, save_s: float) -> int:
        return max(math.floor(save_s / each) + 1, round(seconds / each))

    if not costs.two_tiers:
        return Intervals(steps(daly_s(costs.save_s, mtbf_s), max(costs.save_s, costs.write_s))), 1.0
    local = steps(daly_s(costs.local_save_s, mtbf_s), costs.local_save_s)
    loss = local_loss_probability(costs, local * costs.step_s, failures.mtbf_gpu_h * HOUR_S, gpus_per_node, peer_copy)
    floor_s = max(costs.save_s, costs.write_s)
    every = steps(daly_s(costs.save_s, mtbf_s / loss), floor_s)
    # A whole number of local intervals, still longer than the persistent save and its write.
    least = math.ceil((math.floor(floor_s / each) + 1) / local)
    return Intervals(max(least, round(every / local)) * local, local), loss


def expected_goodput(costs: JobCosts, intervals: Intervals, mtbf_s: float) -> float | None:
    """Daly's expected goodput of one tier (persistent saves only; None for two: `simulate` them)."""
    if intervals.local_every is not None:
        return None
    each = costs.step_s + costs.step_overhead_s  # of which only the step counts
    return daly_goodput(intervals.every * each, costs.save_s, costs.restart_s(local=False), mtbf_s) * costs.step_s / each

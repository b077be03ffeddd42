"""`train --ckpt-every auto`: the checkpoint intervals planned inside the run, from what its own
first steps and saves cost and a failure model (`plan_intervals`, Daly's interval per tier).

The run cannot know its costs before it has paid them, so an attempt probes first: two local
saves (with a local tier) after `LOCAL_PROBES` steps, the second one timed (the first compiles
the copy to the peer: 79 against 14 ms here), and a persistent one after `PROBE`, whose write it
waits for once (the write floors the persistent interval). Then process 0 plans from this
attempt's mean step, the probes' blocking times and the write, and every process takes its plan:
the saves are collectives, so the processes must agree on one schedule. A restart plans again
from its own probes.
"""
from __future__ import annotations

import dataclasses
import json
import statistics

from xlaopt.goodput.costs import JobCosts
from xlaopt.goodput.failures import FailureModel
from xlaopt.goodput.interval import Intervals, plan_intervals

AUTO = "auto"
PROBE, LOCAL_PROBES = 10, (4, 7)  # steps into an attempt


@dataclasses.dataclass(frozen=True)
class Probes:
    """What an attempt measured before planning."""
    step_s: list[float]
    save_s: float  # the persistent probe's blocking time
    write_s: float  # from the persistent probe's start to its commit
    startup_s: float
    restore_s: float | None = None
    local_save_s: float | None = None
    local_restore_s: float | None = None


def plan(probes: Probes, failures: FailureModel, gpus: int, gpus_per_node: int, peer_copy: bool) -> dict:
    """The intervals (`every`, `local_every` or None) and what they were planned from, JSON-able.
    A restore not measured yet (a fresh attempt) takes its save's time: it does not move Daly's
    interval, only the goodput the plan expects."""
    steps = probes.step_s[1:] or probes.step_s  # the attempt's first step warms up
    local = probes.local_save_s is not None
    costs = JobCosts(step_s=statistics.fmean(steps), save_s=probes.save_s,
                     restore_s=probes.restore_s if probes.restore_s is not None else probes.save_s,
                     startup_s=probes.startup_s, gap_s=0.0, write_s=probes.write_s,
                     local_save_s=probes.local_save_s,
                     local_restore_s=(probes.local_restore_s if probes.local_restore_s is not None
                                      else probes.local_save_s) if local else None)
    intervals, loss = plan_intervals(costs, failures, gpus, gpus_per_node, peer_copy)
    return {"every": intervals.every, "local_every": intervals.local_every, "local_loss": loss,
            "job_mtbf_s": failures.job_mtbf_s(gpus), "mtbf_gpu_h": failures.mtbf_gpu_h, "gpus": gpus,
            "failures": failures.source, "costs": {k: v for k, v in dataclasses.asdict(costs).items() if k != "sources"}}


def intervals_of(planned: dict) -> Intervals:
    return Intervals(planned["every"], planned["local_every"])


def describe(planned: dict) -> str:
    c = planned["costs"]
    local = (f", local every {planned['local_every']} (a local save {1e3 * c['local_save_s']:.1f} ms)"
             if planned["local_every"] else "")
    return (f"checkpoint intervals planned (Daly's): persistent every {planned['every']} steps (a save blocks "
            f"{1e3 * c['save_s']:.1f} ms, writes in {c['write_s']:.2f} s){local}; a step {1e3 * c['step_s']:.1f} ms, "
            f"the job's MTBF {planned['job_mtbf_s'] / 3600:.3g} h ({planned['gpus']} devices at "
            f"{planned['mtbf_gpu_h']:,.0f} h each: {planned['failures']})")


def to_json(planned: dict) -> str:
    return json.dumps(planned, sort_keys=True)

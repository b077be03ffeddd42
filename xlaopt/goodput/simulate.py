"""A long job run failure by failure: a discrete-event simulation of training with checkpoints.

The job alternates steps and saves; failures arrive at random, exponential gaps of the job's MTBF
drawn from each attempt's start (an attempt can fail while it starts or restores), or as a fault-
injection harness makes them (`Harness`). After one the job waits the gap, starts (`startup_s`;
its first start is `cold_start_s`), restores the newest checkpoint it still holds (the local
tier's unless the failure took it too, with probability `local_loss`) and carries on from there:
the steps done since that checkpoint are done again. A save cut short by a failure commits
nothing, and a persistent save counts only once its write behind the loop (`write_s`) is done. Time is kept by the causes a run's own
goodput ledger keeps (`xlaopt.runtime.goodput`), so a simulated run and a measured one read
alike; at the end the steps done count as done.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random
import statistics

from xlaopt.goodput.costs import JobCosts
from xlaopt.goodput.interval import Intervals

CAUSES = ("startup_compile_s", "checkpoint_save_s", "checkpoint_restore_s", "lost_progress_s", "restart_gaps_s",
          "other_s")


@dataclasses.dataclass(frozen=True)
class Harness:
    """Failures as `experiments/fault_injection.py` makes them, instead of at random times: an
    attempt is killed once it has done `low` to `high` steps (uniformly) past the furthest step any
    attempt reached, and `late` steps more (the harness's reaction: it polls the ledger, finds the
    process, then kills it; measured by the harness), `kills` times in all; the run ends when
    `steps` steps are done."""
    steps: int
    kills: int
    low: int = 20
    high: int = 400
    late: int = 0


class _Run:
    def __init__(self, costs: JobCosts, intervals: Intervals, horizon_s: float, rng: random.Random):
        self.costs, self.intervals, self.horizon_s, self.rng = costs, intervals, horizon_s, rng
        self.t = self.executed_s = 0.0
        self.badput: collections.Counter = collections.Counter()
        self.stop, self.kill_step = horizon_s, math.inf
        self.step = self.local = self.persistent = self.furthest = self.restarts = 0
        self.written = (0, 0.0)  # the newest persistent save and when its write is done

    def phase(self, cause: str, seconds: float) -> bool:
        """Spend `seconds` on `cause`; False, having spent up to it, if a failure or the end comes first."""
        end = min(self.t + seconds, self.stop)
        self.badput[cause] += end - self.t
        finished, self.t = end == self.t + seconds, end
        return finished

    def train(self, steps: int) -> int:
        """Run up to `steps` steps; the number finished before a failure or the end. A step's work
        outside its timed part (`step_overhead_s`) is `other` time, as the ledger counts it."""
        each = self.costs.step_s + self.costs.step_overhead_s
        seconds = steps * each
        end = min(self.t + seconds, self.stop)
        self.executed_s += (end - self.t) * self.costs.step_s / each
        self.badput["other_s"] += (end - self.t) * self.costs.step_overhead_s / each
        done = steps if end == self.t + seconds else int((end - self.t) / each)
        self.t = end
        return done

    def attempt(self, from_local: bool | None, end_step: float) -> bool:
        """One attempt, from its start (a fresh one, or a restart restoring the local tier's copy or
        the persistent one) to a failure, the horizon or `end_step`; whether it failed."""
        costs, every = self.costs, self.intervals.every
        unit = self.intervals.local_every or every
        self.step = 0 if from_local is None else (self.local if from_local else self.persistent)
        restore_s = costs.local_restore_s if from_local else costs.restore_s
        cold = from_local is None and not self.restarts and costs.cold_start_s is not None
        if not self.phase("startup_compile_s", costs.cold_start_s if cold else costs.startup_s) or (
                self.step > 0 and not self.phase("checkpoint_restore_s", restore_s)):
            return self.t < self.horizon_s
        while True:
            limit = min((self.step // unit + 1) * unit, end_step, self.kill_step)
            self.step += self.train(limit - self.step)
            if self.step < limit:
                return self.t < self.horizon_s
            if self.step in (self.kill_step, end_step):
                return self.step == self.kill_step
            to_persistent = self.step % every == 0
            if not self.phase("checkpoint_save_s", costs.save_s if to_persistent else costs.local_save_s):
                return self.t < self.horizon_s
            self.local = self.step
            if to_persistent:
                self.commit()
                self.written = (self.step, self.t + costs.write_s)

    def commit(self) -> None:
        """The newest persistent save counts once its write is done."""
        if self.written[1] <= self.t:
            self.persistent = self.written[0]

    def restart(self, local_loss: float) -> bool | None:
        """After a failure: whether the next attempt restores the local tier's copy; None if the
        run ends during the gap (its progress is then the copy it would restore)."""
        self.commit()
        self.restarts += 1
        lost_local = self.intervals.local_every is None or self.rng.random() < local_loss
        if lost_local:
            self.local = self.persistent
        self.stop = self.horizon_s
        if not self.phase("restart_gaps_s", self.costs.gap_s):
            self.step = self.local if not lost_local else self.persistent
            return None
        return not lost_local


def simulate(costs: JobCosts, intervals: Intervals, mtbf_s: float, horizon_s: float, seed: int,
             local_loss: float = 1.0, harness: Harness | None = None) -> dict:
    """One run of `horizon_s` seconds (with a `harness`: until its steps are done): goodput,
    restarts and the time spent on each cause."""
    run = _Run(costs, intervals, horizon_s, random.Random(seed))
    end_step, from_local, kills = (harness.steps if harness else math.inf), None, 0
    while True:
        if harness is None:
            run.stop = min(run.t + run.rng.expovariate(1 / mtbf_s), horizon_s)
        elif kills < harness.kills:
            run.kill_step = run.furthest + run.rng.randint(harness.low, harness.high) + harness.late
        else:
            run.kill_step = math.inf
        failed = run.attempt(from_local, end_step)
        run.furthest = max(run.furthest, run.step)
        if not failed:
            break
        kills += 1
        from_local = run.restart(local_loss)
        if from_local is None:
            break
    productive = run.step * costs.step_s
    badput = {cause: run.badput[cause] for cause in CAUSES}
    badput["lost_progress_s"] = run.executed_s - productive
    return {"goodput": productive / run.t, "wall_s": run.t, "productive_s": productive, "badput": badput,
            "restarts": run.restarts}


def simulate_many(costs: JobCosts, intervals: Intervals, mtbf_s: float, horizon_s: float, seeds: int,
                  local_loss: float = 1.0, harness: Harness | None = None) -> dict:
    """`seeds` runs: goodput's mean and spread (5th and 95th percentiles), the mean of the rest."""
    runs = [simulate(costs, intervals, mtbf_s, horizon_s, seed, local_loss, harness) for seed in range(seeds)]
    goodputs = sorted(r["goodput"] for r in runs)
    pick = lambda q: goodputs[min(len(goodputs) - 1, round(q * (len(goodputs) - 1)))]  # noqa: E731
    return {"goodput": statistics.fmean(goodputs), "goodput_p5": pick(0.05), "goodput_p95": pick(0.95),
            "restarts": statistics.fmean(r["restarts"] for r in runs),
            "badput": {c: statistics.fmean(r["badput"][c] for r in runs) for c in CAUSES},
            "seeds": seeds, "wall_s": statistics.fmean(r["wall_s"] for r in runs)}

"""A long job run failure by failure: a discrete-event simulation of training with checkpoints.

The job alternates steps and saves; failures arrive at random, exponential gaps of the job's MTBF
drawn from each attempt's start (an attempt can fail while it starts or restores). After one the
job waits the gap, starts (`startup_s`), restores the newest checkpoint it still holds (the local
tier's unless the failure took it too, with probability `local_loss`) and carries on from there:
the steps done since that checkpoint are done again. A save cut short by a failure commits
nothing, and a persistent save counts only once its write behind the loop (`write_s`) is done.
Time is kept by the causes a run's own goodput ledger keeps (`xlaopt.runtime.goodput`),
so a simulated run and a measured one read alike; at the horizon the steps done count as done.
"""
from __future__ import annotations

import collections
import random
import statistics

from xlaopt.goodput.costs import JobCosts
from xlaopt.goodput.interval import Intervals

CAUSES = ("startup_compile_s", "checkpoint_save_s", "checkpoint_restore_s", "lost_progress_s", "restart_gaps_s")


class _Run:
    def __init__(self, costs: JobCosts, intervals: Intervals, horizon_s: float):
        self.costs, self.intervals, self.horizon_s = costs, intervals, horizon_s
        self.t = self.executed_s = 0.0
        self.badput: collections.Counter = collections.Counter()
        self.stop = horizon_s

    def phase(self, cause: str, seconds: float) -> bool:
        """Spend `seconds` on `cause`; False, having spent up to it, if a failure or the end comes first."""
        end = min(self.t + seconds, self.stop)
        self.badput[cause] += end - self.t
        finished, self.t = end == self.t + seconds, end
        return finished

    def train(self, steps: int) -> int:
        """Run up to `steps` steps; the number finished before a failure or the end."""
        seconds = steps * self.costs.step_s
        end = min(self.t + seconds, self.stop)
        self.executed_s += end - self.t
        done = steps if end == self.t + seconds else int((end - self.t) / self.costs.step_s)
        self.t = end
        return done


def simulate(costs: JobCosts, intervals: Intervals, mtbf_s: float, horizon_s: float, seed: int,
             local_loss: float = 1.0) -> dict:
    """One run of `horizon_s` seconds: goodput, restarts and the time spent on each cause."""
    rng = random.Random(seed)
    run, step, local, persistent, restarts = _Run(costs, intervals, horizon_s), 0, 0, 0, 0
    every, unit = intervals.every, intervals.local_every or intervals.every
    from_local = None  # a fresh start; then whether a restart restores the local tier's copy
    written = (0, 0.0)  # the newest persistent save and when its write is done
    while True:
        run.stop = min(run.t + rng.expovariate(1 / mtbf_s), horizon_s)
        step = 0 if from_local is None else (local if from_local else persistent)
        ok = run.phase("startup_compile_s", costs.startup_s)
        if ok and step > 0:
            ok = run.phase("checkpoint_restore_s", costs.local_restore_s if from_local else costs.restore_s)
        while ok:
            target = (step // unit + 1) * unit
            done = run.train(target - step)
            step += done
            if step < target:
                break
            to_persistent = step % every == 0
            if not run.phase("checkpoint_save_s", costs.save_s if to_persistent else costs.local_save_s):
                break
            local = step
            if to_persistent:
                if written[1] <= run.t:  # the previous write is done (the interval's floor sees to it)
                    persistent = written[0]
                written = (step, run.t + costs.write_s)
        if run.t >= horizon_s:
            break
        if written[1] <= run.t:
            persistent = written[0]
        restarts += 1
        lost_local = intervals.local_every is None or rng.random() < local_loss
        from_local = not lost_local
        if lost_local:
            local = persistent
        run.stop = horizon_s
        if not run.phase("restart_gaps_s", costs.gap_s):
            step = persistent if lost_local else local
            break
    productive = step * costs.step_s
    badput = {cause: run.badput[cause] for cause in CAUSES}
    badput["lost_progress_s"] = run.executed_s - productive
    return {"goodput": productive / horizon_s, "wall_s": horizon_s, "productive_s": productive, "badput": badput,
            "restarts": restarts}


def simulate_many(costs: JobCosts, intervals: Intervals, mtbf_s: float, horizon_s: float, seeds: int,
                  local_loss: float = 1.0) -> dict:
    """`seeds` runs: goodput's mean and spread (5th and 95th percentiles), the mean of the rest."""
    runs = [simulate(costs, intervals, mtbf_s, horizon_s, seed, local_loss) for seed in range(seeds)]
    goodputs = sorted(r["goodput"] for r in runs)
    pick = lambda q: goodputs[min(len(goodputs) - 1, round(q * (len(goodputs) - 1)))]  # noqa: E731
    return {"goodput": statistics.fmean(goodputs), "goodput_p5": pick(0.05), "goodput_p95": pick(0.95),
            "restarts": statistics.fmean(r["restarts"] for r in runs),
            "badput": {c: statistics.fmean(r["badput"][c] for r in runs) for c in CAUSES},
            "seeds": seeds, "wall_s": horizon_s}

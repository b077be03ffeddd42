"""What a checkpoint and a failure cost a job: measured from a run's goodput ledger, or given."""
from __future__ import annotations

import dataclasses
import math
import statistics

from xlaopt.errors import UserError

FIELDS = {  # field -> the flag that gives it
    "step_s": "--step-s", "save_s": "--save-s", "restore_s": "--restore-s", "startup_s": "--startup-s",
    "gap_s": "--gap-s", "write_s": "--write-s", "step_overhead_s": "--step-overhead-s",
    "local_save_s": "--local-save-s", "local_restore_s": "--local-restore-s", "cold_start_s": "--cold-start-s"}
# Costs that default to nothing when neither a flag nor the ledger gives them.
OPTIONAL = ("write_s", "step_overhead_s", "local_save_s", "local_restore_s", "cold_start_s")


@dataclasses.dataclass(frozen=True)
class JobCosts:
    step_s: float  # one training step
    save_s: float  # the time a persistent save blocks the loop (an async save: until its copy off the devices)
    restore_s: float  # restoring the state from the persistent tier
    startup_s: float  # a restarted process's start to its first step, restore excluded (compile, warm cache)
    gap_s: float  # from a failure to the next attempt's start: noticing it and launching again
    # A persistent save's write behind the loop (an async save): the checkpoint counts only once it
    # is written, and the next save waits for it, so it is a floor on the interval.
    write_s: float = 0.0
    step_overhead_s: float = 0.0  # a step's host work outside its timed part (the ledger's `other`)
    local_save_s: float | None = None  # the local tier's save and restore, when the job keeps one
    local_restore_s: float | None = None
    # The job's first start, when it differs from a restart's: a cold compile, or a launcher's
    # imports that its restarts (forked from them) skip. None: as `startup_s`.
    cold_start_s: float | None = None
    sources: tuple[tuple[str, str], ...] = ()  # (field, where its value came from)

    def __post_init__(self):
        for name, flag in FIELDS.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL:
                continue
            if value is None or not (math.isfinite(value) and value >= 0):
                raise UserError(f"{flag} {value}: must be a finite number of seconds >= 0")
        if self.step_s <= 0:
            raise UserError(f"--step-s {self.step_s:g}: a step takes some time; give its seconds (> 0)")
        if (self.local_save_s is None) != (self.local_restore_s is None):
            raise UserError("a local tier needs both --local-save-s and --local-restore-s")

    @property
    def two_tiers(self) -> bool:
        return self.local_save_s is not None

    def restart_s(self, local: bool) -> float:
        """A failure's cost besides the work lost: the gap, the start-up and the restore."""
        return self.gap_s + self.startup_s + (self.local_restore_s if local else self.restore_s)


def measured(events: list[dict]) -> dict[str, float]:
    """What a run's ledger (`xlaopt.runtime.goodput`) measured, as means (a run's totals follow the
    mean, not the median: a job whose attempts run on other layouts has steps of two speeds): a
    step after each attempt's first, a save and a restore; a restart's start-up (the first
    attempt's, a cold compile, only when no restart was recorded), the first attempt's own, and
    the gap between attempts.
    Absent causes are left out."""
    from xlaopt.runtime.goodput import attempts, restart_times

    runs = attempts(events)
    out: dict[str, float] = {}
    steps = [e["dt"] for run in runs for e in [e for e in run if "step" in e][1:]]
    if steps:
        out["step_s"] = statistics.fmean(steps)
    for key, name in (("save_s", "save_s"), ("restore_s", "restore_s"), ("local_save_s", "local_save_s"),
                      ("local_restore_s", "local_restore_s")):
        values = [e[key] for run in runs for e in run if key in e]
        if values:
            out[name] = statistics.fmean(values)
    restarts = restart_times(runs)
    cold = [e["setup_s"] for e in runs[0] if "setup_s" in e] if runs else []
    if restarts:
        out["startup_s"] = statistics.fmean(r["setup_s"] for r in restarts)
        out["gap_s"] = statistics.fmean(r["gap_s"] for r in restarts)
    elif cold:
        out["startup_s"] = cold[0]
    if cold:
        out["cold_start_s"] = cold[0]
    return out


def job_costs(ledger: list[dict] | None = None, **given: float | None) -> JobCosts:
    """Costs from `given` values (None: not given) over what `ledger` measured; a cost neither gives
    is an error naming its flag."""
    found = measured(ledger) if ledger else {}
    values, sources = {}, []
    for name, flag in FIELDS.items():
        if given.get(name) is not None:
            values[name], source = given[name], "given"
        elif name in found:
            values[name], source = found[name], "the run's ledger"
        elif name in OPTIONAL:
            continue
        else:
            where = " (the ledger has none)" if ledger else ""
            raise UserError(f"no {name.removesuffix('_s').replace('_', ' ')} time{where}: give {flag} SECONDS, or "
                            f"--ledger DIR of a run that recorded one")
        sources.append((name, source))
    return JobCosts(**values, sources=tuple(sources))

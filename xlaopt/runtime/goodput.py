"""Goodput: how much of a job's wall time went into steps that count, and where the rest went.

A job may run as several attempts: each restart (after a crash, a kill, a SIGTERM) resumes
from the last committed checkpoint, and the steps an attempt had run past it are done again.
Process 0 keeps the job's ledger in the checkpoint directory (`goodput.jsonl`, one JSON object
a line, flushed as written, so a killed attempt leaves what it did): an attempt's start, each
step's times, each save and restore. A fresh run (no `--resume`) starts a new ledger.

Badput causes: start-up and compile (process start to the first step, restores excluded), data
wait, checkpoint save (the time a save blocked the loop) and restore, of either tier (a local
save is `local_save_s`, a local restore `local_restore_s`), progress lost to a failure
(the step and data time of steps run again after a restart), and the gaps between attempts
(from the last thing a failed attempt did to the next attempt's start). What is left of the
wall time (progress bar, teardown) is `other`. Each restart's own time to its first step (the
gap, start-up and restore) is kept beside the first attempt's cold start.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

from xlaopt.errors import UserError

LEDGER = "goodput.jsonl"
# A process's start for its start-up badput, when not its own: a launched job's first processes
# (forked from a zygote that imported JAX for them) count from the launcher's start.
STARTED_ENV = "XLAOPT_STARTED"


class Ledger:
    def __init__(self, directory: str | None, started: float, resume: bool, write: bool):
        self.path = pathlib.Path(directory) / LEDGER if directory is not None else None
        self.events: list[dict] = []
        self._file = None
        self.writes = self.path is not None and write
        if self.writes:
            cut = resume and self.path.exists() and not self.path.read_bytes().endswith(b"\n")
            self._file = open(self.path, "a" if resume else "w")
            if cut and self.path.stat().st_size:
                self._file.write("\n")  # end a line cut short by a killed attempt
        self.record(attempt=started)

    def record(self, **event) -> None:
        self.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()

    def step(self, step: int, step_s: float, wait_s: float, loss: float) -> None:
        self.record(step=step, dt=round(step_s, 6), wait=round(wait_s, 6), t=round(time.time(), 3), loss=loss)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def history(self) -> list[dict]:
        """Every attempt's events when this process keeps the ledger, else this attempt's."""
        if not self.writes:
            return self.events
        if self._file is not None:
            self._file.flush()
        return [event for line in self.path.read_text().splitlines() if (event := _parse(line)) is not None]


def read(directory: str) -> list[dict]:
    """The ledger a run kept in its checkpoint directory, every attempt's events."""
    path = pathlib.Path(directory) / LEDGER
    if not path.is_file():
        raise UserError(f"--ledger {directory}: no {LEDGER} there; give the --ckpt directory of an `xlaopt train` run")
    return [event for line in path.read_text().splitlines() if (event := _parse(line)) is not None]


def process_start_time() -> float:
    """When this process started (time.time() scale): Python's start-up and JAX's import belong
    to the start-up badput too. From /proc on Linux (the start in clock ticks since boot, against
    CLOCK_BOOTTIME: to 10 ms; /proc/stat's boot time has 1 s resolution, which once split a
    restart's gap from its start-up wrongly by up to a second), else now."""
    try:
        ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def started_by_launcher(default: float) -> float:
    """This process's start for its start-up badput: the launcher's, when it gave one."""
    try:
        return min(float(os.environ.pop(STARTED_ENV)), default)
    except (KeyError, ValueError):
        return default




def _parse(line: str) -> dict | None:
    try:  # an attempt killed mid-write leaves its last line cut short
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def attempts(events: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for event in events:
        if "attempt" in event:
            out.append([])
        if out:
            out[-1].append(event)
    return out


def goodput(events: list[dict], ended: float) -> dict:
    """The job's goodput and badput by cause, from its ledger; `ended` is the wall time now."""
    runs = attempts(events)
    productive = lost = data_wait = save = restore = setup = 0.0
    lost_steps = 0
    kept: list[float] = []
    for k, run in enumerate(runs):
        steps = [e for e in run if "step" in e]
        restarted_from = _resumed_from(runs[k + 1]) if k + 1 < len(runs) else None
        for e in steps:
            if restarted_from is not None and e["step"] >= restarted_from:
                lost += e["dt"] + e["wait"]
                lost_steps += 1
            else:
                productive += e["dt"]
                data_wait += e["wait"]
                kept.append(e["dt"])
        save += sum(e.get("save_s", 0.0) + e.get("local_save_s", 0.0) for e in run)
        restore += sum(_restore_s(e) for e in run)
        setup += sum(e["setup_s"] for e in run if "setup_s" in e)
    restarts = restart_times(runs)
    gaps = sum(r["gap_s"] for r in restarts)
    wall = ended - runs[0][0]["attempt"]
    badput = {"startup_compile_s": setup, "data_wait_s": data_wait, "checkpoint_save_s": save,
              "checkpoint_restore_s": restore, "lost_progress_s": lost, "restart_gaps_s": gaps}
    badput["other_s"] = max(0.0, wall - productive - sum(badput.values()))
    timed = kept[1:] or kept  # the first step of a run warms up
    median = statistics.median(timed) if timed else 0.0
    return {"goodput": productive / wall if wall > 0 else 0.0, "wall_s": wall, "productive_s": productive,
            "badput": badput, "lost_steps": lost_steps, "restarts": len(runs) - 1,
            "cold_start_s": next((e["setup_s"] for e in runs[0] if "setup_s" in e), None), "restart_times": restarts,
            "step_time_median_s": median,
            "step_time_cv": statistics.pstdev(timed) / statistics.fmean(timed) if len(timed) > 1 else 0.0}


def restart_times(runs: list[list[dict]]) -> list[dict]:
    """Each restart's time from the failed attempt's last act to the next attempt's first step (of
    `attempts(events)`): the gap (noticing the failure, launching again), start-up and compile, and
    the restore."""
    out = []
    for run, following in zip(runs, runs[1:]):
        last = max([run[0]["attempt"]] + [e["t"] for e in run if "t" in e])
        gap = max(0.0, following[0]["attempt"] - last)
        setup = sum(e["setup_s"] for e in following if "setup_s" in e)
        restore = sum(_restore_s(e) for e in following)
        out.append({"gap_s": gap, "setup_s": setup, "restore_s": restore, "to_first_step_s": gap + setup + restore})
    return out


def _restore_s(event: dict) -> float:
    """A restore's time, from either tier."""
    return event.get("restore_s", 0.0) + event.get("local_restore_s", 0.0)


def _resumed_from(run: list[dict]) -> int:
    return next((e["resumed_from"] for e in run if "resumed_from" in e), 0)

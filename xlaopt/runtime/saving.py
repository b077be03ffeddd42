"""A run's checkpoints after each step: which tier saves when, the saves, and `--ckpt-every auto`.

Two tiers (`xlaopt.checkpoint`): the persistent one (`CheckpointManager`, asynchronous) every
`every` steps and after the last, and the local one (`LocalTier`) every `local_every` steps
except where a persistent save is due (a restore takes the newer). With `every="auto"` the
intervals are planned inside the run (`xlaopt.goodput.auto`): an attempt probes each tier once,
waits for the persistent probe's write, and takes process 0's plan.
"""
from __future__ import annotations

import dataclasses
import json
import time

import jax

from xlaopt.checkpoint import coordination
from xlaopt.goodput import auto
from xlaopt.goodput.failures import LLAMA3, FailureModel


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Save to `directory` every `every` steps (or `auto`: planned) and after the last; `resume`
    continues from the newest committed step there (or starts fresh when there is none)."""
    directory: str
    every: int | str | None = None
    resume: bool = False
    keep_last: int = 3
    keep_every: int | None = None
    # The local tier (xlaopt.checkpoint.local): each process's node-local directory under `local`,
    # a save every `local_every` steps (or `auto`), copied to `local_peers` other processes.
    local: str | None = None
    local_every: int | str | None = None
    local_peers: int = 0
    failures: FailureModel = LLAMA3  # what `auto` plans for


class Saves:
    """The saves of one attempt, step by step; `records` are the persistent saves, for the summary."""

    def __init__(self, ckpt: CheckpointOptions, manager, local, ledger, start: int, collective, attempt: dict):
        self.ckpt, self.manager, self.local, self.ledger, self.start = ckpt, manager, local, ledger, start
        self.collective = collective  # a context for collectives that may lose a peer (the local copy)
        self.attempt = attempt  # this attempt's start-up (`setup_s`) and restore (`restore_s` or `local_restore_s`)
        self.every = None if ckpt.every == auto.AUTO else ckpt.every
        self.local_every = None if ckpt.local_every == auto.AUTO else ckpt.local_every
        self.planning = auto.AUTO in (ckpt.every, ckpt.local_every)
        self.records: list[dict] = []
        self.planned: dict | None = None
        self._probe: dict = {}

    def after(self, done: int, steps: int, state, meta, stopping: bool, step_times) -> None:
        """Save what is due once `done` steps are done; `meta()` gives the run's meta, `step_times()`
        this attempt's step times so far."""
        probing = self.planning and self.planned is None
        if self.manager is not None and (done == steps or stopping or self._due(self.every, done)
                                         or (probing and done == self.start + auto.PROBE)):
            t0 = time.perf_counter()
            info = self.manager.save(done, state, meta())
            self.records.append({"step": info.step, "bytes": info.bytes, "blocking_s": info.blocking_s})
            self.ledger.record(save_s=info.blocking_s, t=round(time.time(), 3))
            if probing and done == self.start + auto.PROBE and done < steps:
                self.manager.wait()  # once: the write floors the persistent interval
                self._plan(info.blocking_s, time.perf_counter() - t0, step_times())
        elif self.local is not None and (self._due(self.local_every, done)
                                         or (probing and done - self.start in auto.LOCAL_PROBES)):
            with self.collective():  # the copy to a peer is a collective too
                seconds = self.local.save(done, state, meta())
            self.ledger.record(local_save_s=seconds, t=round(time.time(), 3))
            self._probe["local_save_s"] = seconds  # the last one before the plan: the first compiled

    @staticmethod
    def _due(every: int | None, done: int) -> bool:
        return every is not None and done % every == 0

    def _plan(self, save_s: float, write_s: float, step_times: list[float]) -> None:
        """Process 0 plans from this attempt's probes; every process takes its plan."""
        ckpt, attempt = self.ckpt, self.attempt
        planned = ""
        if jax.process_index() == 0:
            probes = auto.Probes(step_times, save_s, write_s, attempt["setup_s"], attempt.get("restore_s"),
                                 self._probe.get("local_save_s"), attempt.get("local_restore_s"))
            devices = jax.device_count()
            planned = auto.to_json(auto.plan(probes, ckpt.failures, devices, jax.local_device_count(),
                                             peer_copy=ckpt.local_peers > 0))
        self.planned = planned = json.loads(coordination.share("xlaopt-auto-plan", planned)[0])
        if ckpt.every == auto.AUTO:
            self.every = planned["every"]
        if ckpt.local_every == auto.AUTO:
            self.local_every = planned["local_every"]
        elif self.local_every is not None and self.every is not None:  # a persistent save replaces a local one
            self.every = -(-self.every // self.local_every) * self.local_every
        planned.update(every=self.every, local_every=self.local_every if self.local is not None else None)
        self.ledger.record(planned=planned)
        if jax.process_index() == 0:
            print(f"xlaopt train: {auto.describe(planned)}", flush=True)

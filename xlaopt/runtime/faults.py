"""What a training process does when its job misbehaves: a peer dies or stops, a loss goes
non-finite, or someone asks the job to stop (SIGTERM).

Checked on jax 0.10.2 (tests/test_faults.py runs each case):
- a peer killed or stopped (SIGKILL, SIGSTOP) mid-step leaves the others blocked inside a gloo
  collective, which gives up only after 30 minutes. JAX's coordination service notices the
  missing heartbeats after `heartbeat_timeout_seconds` and then aborts every other process from
  C++ (SIGABRT, exit 134, a stack trace). A peer that is alive but stuck keeps heartbeating and
  is never noticed at all.
- so each process runs a `PeerWatch`: the training loop marks its progress, a beat thread
  publishes this process's step in the coordination service's key-value store every second and
  reads everyone's, and a watchdog thread that makes no calls of its own stops the process with
  one clear line once no step has finished for `timeout_s`, naming the peer that went silent
  (dead or stopped), the one that fell behind (stuck), or process 0 when its service no longer
  answers. JAX's own heartbeat timeout is set beyond ours, so ours speaks first.
- JAX's preemption notifier installs its own SIGTERM handler, so a Python handler would never
  run in a multi-process job; `multihost_utils.reached_preemption_sync_point` is how every
  process learns of the signal and agrees on one step to stop after. A single process, with
  no notifier, uses a Python handler.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from xlaopt.errors import EXIT_PEER_LOST, RunFailed, UserError

DEFAULT_PEER_TIMEOUT_S = 60.0


def peer_timeout_s(given: float | None) -> float:
    """`--peer-timeout`: seconds in (0, one day], the default when not given."""
    timeout = DEFAULT_PEER_TIMEOUT_S if given is None else given
    if not 0 < timeout <= 86400:
        raise UserError(f"--peer-timeout {given:g}: need seconds in (0, 86400]")
    return timeout


class PeerLost(RunFailed):
    """A collective failed because a peer process went away."""
    exit_code = EXIT_PEER_LOST


class PeerWatch:
    """Stops this process, with a message naming the culprit, when its job stops making progress.

    The training loop calls `entering()` as it starts a step and `progress(step)` once `step`
    steps are done; between `arm()` and `disarm()` (the step loop) a gap longer than
    `timeout_s` between two `progress` calls is a failure. Beats carry both, so a peer stuck
    outside the step (its host code, say its data reader) is told from peers inside it.
    """

    def __init__(self, timeout_s: float, client, process_id: int, num_processes: int, name: str = "xlaopt train"):
        if not timeout_s > 0:
            raise UserError(f"--peer-timeout {timeout_s}: must be a positive number of seconds")
        self.timeout_s, self.client, self.me, self.n, self.name = timeout_s, client, process_id, num_processes, name
        self.beat_s = min(1.0, timeout_s / 10)
        # A peer whose beat has not moved for this long is not running (dead or stopped).
        self.silent_s = max(5 * self.beat_s, min(10.0, timeout_s / 2))
        self._step, self._last = 0, time.monotonic()
        self._in_step = self._armed = False
        self._rpc_ok = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (beat value, when it last changed)
        self._failed: dict[int, str] = {}  # peer -> the error it reported
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name="xlaopt-peer-beat", daemon=True),
                         threading.Thread(target=self._watch, name="xlaopt-peer-watch", daemon=True)]

    def __enter__(self):
        now = time.monotonic()
        self._rpc_ok = now
        self._seen = {p: ("", now) for p in range(self.n) if p != self.me}  # silent since the start, at worst
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def arm(self, step: int) -> None:
        self.progress(step)
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def entering(self) -> None:
        self._in_step = True

    def progress(self, step: int) -> None:
        self._step, self._last, self._in_step = step, time.monotonic(), False

    # -- threads ---------------------------------------------------------------------------
    def _beat(self) -> None:
        beats = 0
        while not self._stop.wait(self.beat_s):
            beats += 1
            try:
                self.client.key_value_set(f"xlaopt/beat/{self.me}", f"{beats} {self._step} {int(self._in_step)}",
                                          allow_overwrite=True)
                values = dict(self.client.key_value_dir_get("xlaopt/beat/"))
                self._failed = {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get("xlaopt/failed/")}
            except Exception:  # the service is gone or unreachable: the watchdog reads the silence
                continue
            now = time.monotonic()
            self._rpc_ok = now
            for key, value in values.items():
                peer = int(key.rsplit("/", 1)[1])
                if peer != self.me and self._seen.get(peer, ("", 0.0))[0] != value:
                    self._seen[peer] = (value, now)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            failed = {p: why for p, why in self._failed.items() if p != self.me}
            if failed:
                p = min(failed)
                self._fail(f"process {p} failed: {failed[p]}", waited=False)
            if self._armed:
                if time.monotonic() - self._last > self.timeout_s:
                    self._fail(self.diagnosis())
                # Between steps the step timeout decides, naming a silent peer: a peer stopped
                # mid-step fell silent up to a beat before this process's last step ended, and
                # its silence alone would otherwise race the timeout to the message.
                continue
            # Silent that long is lost in the phases where no step is expected to finish
            # (start-up, a save's commit, the final wait).
            why, silent = self._diagnose(self.timeout_s)
            if silent:
                self._fail(why, waited=False)

    def lost(self, error: Exception) -> PeerLost:
        """The error for a collective that failed (gloo saw a peer's connection close), naming
        the peer once its beats stop. The failure already says a peer is gone, so a beat that has
        not moved for 2.5 beats names it (a live peer's moves every beat): about 2 s here, where
        waiting for `silent_s` of silence took 5."""
        deadline = time.monotonic() + self.silent_s + 2 * self.beat_s
        quick = 2.5 * self.beat_s
        why, silent = self._diagnose(quick)
        while not silent and time.monotonic() < deadline:
            time.sleep(self.beat_s / 4)
            why, silent = self._diagnose(quick)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return PeerLost(f"process {self.me}: a collective of step {self._step + 1} failed ({first}): {why}. "
                        f"The last committed checkpoint is intact; rerun with --resume")

    def report(self, why: str) -> None:
        """Tell the peers this process is failing, so they stop now instead of after the timeout."""
        put = lambda: self.client.key_value_set(f"xlaopt/failed/{self.me}", why.splitlines()[0][:500] if why else "?")
        thread = threading.Thread(target=put, daemon=True)
        thread.start()
        thread.join(2.0)  # the service may be gone with its process

    def diagnosis(self) -> str:
        """Who stopped the job, as far as this process can tell."""
        return self._diagnose()[0]

    def _diagnose(self, silent_s: float | None = None) -> tuple[str, bool]:
        """(who stopped the job, whether a process was silent for `silent_s`: dead or stopped)."""
        now, silent_s = time.monotonic(), self.silent_s if silent_s is None else silent_s
        if now - self._rpc_ok > silent_s:
            return (f"the coordination service on process 0 has not answered for {now - self._rpc_ok:.0f} s: "
                    f"process 0 is dead or stopped", True)
        silent = [p for p, (_, since) in sorted(self._seen.items()) if now - since > silent_s]
        if silent:
            ages = ", ".join(f"process {p} (silent {now - self._seen[p][1]:.0f} s)" for p in silent)
            return f"{ages} stopped sending beats: dead or stopped (SIGSTOP)", True
        where = {p: tuple(map(int, value.split()[1:])) for p, (value, _) in self._seen.items() if value}
        mine = (self._step, int(self._in_step))
        behind = sorted(p for p, at in where.items() if at < mine)
        if behind:
            return ", ".join(f"process {p} ({where[p][0]} steps done, "
                             f"{'inside' if where[p][1] else 'not yet in'} step {where[p][0] + 1})" for p in behind) \
                + " is alive but stuck", False
        return "every process is alive and inside the step: a collective that never completes", False

    def _fail(self, why: str, waited: bool = True) -> None:
        waiting = (f"no step finished for {self.timeout_s:g} s (waiting in step {self._step + 1}): " if waited
                   else "")
        print(f"{self.name}: error: process {self.me}: {waiting}{why}. Stopping; the last committed checkpoint "
              f"is intact, rerun with --resume" + (" (and a larger --peer-timeout if one step can take that long)"
                                                   if waited else ""), file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not sys.exit: the main thread is blocked in a collective that will not return, and
        # jax.distributed's exit handler would wait on the lost peer too.
        os._exit(EXIT_PEER_LOST)


class StopSignal:
    """SIGTERM as a request to stop after an agreed step (its final checkpoint, then exit 0)."""

    def __init__(self, multi_process: bool):
        self.multi_process = multi_process
        self.received = False
        self._previous = None
        if not multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def reached(self, step: int) -> bool:
        """Whether to stop once `step` steps are done; the same answer on every process."""
        if not self.multi_process:
            return self.received
        from jax.experimental import multihost_utils

        self.received = self.received or multihost_utils.reached_preemption_sync_point(step)
        return self.received

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

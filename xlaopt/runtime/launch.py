"""`xlaopt train --processes N`: a local multi-process job, started and supervised as one.

Each of the N processes is `xlaopt train` itself with `--coordinator 127.0.0.1:PORT
--num-processes N --process-id I` added (a free loopback port, so the coordination service
listens on loopback only), bringing its share of the mesh's devices. Process 0 reports. The
processes are forked from one zygote that has imported JAX and the training code once
(xlaopt.runtime.zygote). With `--restarts K` a failed job is started again, every process
with `--resume`, up to K times: a restart then costs no Python start-up and no import. When a
process fails the others stop on their own within `--peer-timeout` (xlaopt.runtime.faults);
whichever has not after that, and a grace period, is killed, so the job never hangs. A process
killed by a signal takes the others with it at once: this launcher names it. SIGTERM
or Ctrl-C to the launcher is passed on: the job agrees on a step, saves once and exits 0.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from xlaopt.errors import EXIT_PEER_LOST, EXIT_RUN_FAILED, EXIT_USER_ERROR
from xlaopt.runtime.distributed import DistributedError, free_port
from xlaopt.runtime.goodput import STARTED_ENV, process_start_time
from xlaopt.runtime.zygote import Zygote

GRACE_S = 5.0  # beyond --peer-timeout: a process failing on its own has printed why and exited by then
# Failures a restart would only repeat: bad input, and a run that stopped itself (a non-finite loss).
NOT_RESTARTED = (EXIT_USER_ERROR, EXIT_RUN_FAILED)


def strip_option(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag VALUE` / `flag=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def launch(argv: list[str], processes: int, peer_timeout_s: float, restarts: int = 0) -> int:
    """Run `xlaopt train argv` as `processes` local processes, forked from one zygote
    (xlaopt.runtime.zygote); up to `restarts` times after a failure, all of them again with
    `--resume`. The job's exit status."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # each process asks for its own share of the devices
    started = process_start_time()
    zygote = Zygote(env)
    children: list = []
    stopping: list[int] = []  # a stop asked for is not a failure to restart from

    def forward(signum, frame):
        stopping.append(signum)
        for c in children:
            c.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        attempt = 0
        while True:  # returns when a job ends that is not to be restarted
            port = free_port()
            # The first processes count their start-up from the launcher's start, a restart's from its fork.
            first = {STARTED_ENV: repr(started) if attempt == 0 else None}
            children[:] = [zygote.spawn(["train", *argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                         str(processes), "--process-id", str(i)] + (["--no-progress"] if i else []),
                                        first, f"xlaopt-train-{i}")
                           for i in range(processes)]
            code = _supervise(children, peer_timeout_s + GRACE_S, lambda: zygote.poll(timeout=0.1))
            if code == 0 or code in NOT_RESTARTED or stopping or attempt == restarts:
                return code
            attempt += 1
            print(f"xlaopt train: restart {attempt} of {restarts}: every process again, from the newest "
                  f"checkpoint", file=sys.stderr, flush=True)
            if "--resume" not in argv:
                argv = [*argv, "--resume"]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        zygote.close()


def _supervise(children: list, deadline_s: float, wait=lambda: time.sleep(0.1)) -> int:
    first, failed_at = None, None
    while [c.poll() for c in children].count(None):  # poll every child: `any` would stop at the first
        if first is None:
            first = next((i for i, c in enumerate(children) if c.returncode not in (None, 0)), None)
            failed_at = time.monotonic() if first is not None else None
            if first is not None and children[first].returncode < 0:
                # Killed by a signal (SIGKILL, a crash): it reported nothing and will finish no step, so
                # the others cannot either. This launcher knows the culprit; stop them now rather
                # than let each find out and name it (seconds, against one restart's few).
                for c in children:
                    if c.poll() is None:
                        c.kill()
        elif time.monotonic() - failed_at > deadline_s:
            stuck = [i for i, c in enumerate(children) if c.poll() is None]
            print(f"xlaopt train: error: process {first} failed ({_status(children[first].returncode)}); "
                  f"process {', '.join(map(str, stuck))} had not stopped {deadline_s:g} s later: killed",
                  file=sys.stderr, flush=True)
            for i in stuck:
                children[i].kill()
        wait()  # the zygote's wakes as soon as a child exits
    codes = [c.returncode for c in children]
    if all(code == 0 for code in codes):
        return 0
    first = first if first is not None else next(i for i, code in enumerate(codes) if code)
    code = codes[first]
    if len(children) > 1:
        print(f"xlaopt train: the job failed: process {first} first ({_status(code)}); exit statuses "
              + ", ".join(f"{i}: {_status(c)}" for i, c in enumerate(codes)), file=sys.stderr, flush=True)
    return code if code > 0 else EXIT_PEER_LOST


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def check_processes(processes: int, coordinator: str | None, mesh_devices: int) -> None:
    if processes < 1:
        raise DistributedError(f"--processes {processes}: need at least 1 process")
    if coordinator is not None:
        raise DistributedError("--processes starts a local job and picks its own coordinator; --coordinator, "
                               "--num-processes and --process-id are for joining a job started elsewhere")
    if mesh_devices % processes:
        raise DistributedError(f"--processes {processes}: the mesh's {mesh_devices} devices do not split over "
                               f"{processes} processes; pick a process count dividing {mesh_devices}")

"""A zygote for a local job's processes: one process that imports JAX and xlaopt's training path
once, then forks each of the job's processes from that state, at its start and at every restart.

Measured on a 2-core host (BENCHMARKS.md, issue 31), a fresh process spent 1.5 s of a restart's
3 s importing Python modules before it did anything of its own; a fork of a process that has
them costs milliseconds. Forking is safe here because the zygote never starts a JAX backend (no
XLA client, no thread pool of JAX's): each child starts its own, joins the job, and runs
`xlaopt train` as if it had been started on its own.

The launcher talks to the zygote over two pipes, never a socket: requests on its stdin and
replies on a pipe the launcher passes it, JSON lines both ways (nothing is unpickled). Each
request is one child to fork (its command line, its environment changes); each reply says a
child started or exited (`os.waitstatus_to_exitcode`: negative for a signal). The zygote reaps
its children as they exit (SIGCHLD wakes it), stops taking requests when the launcher closes
its stdin, and exits once its children have.
"""
from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import subprocess
import sys

# What a training process imports before its first step: imported once, here.
PRELOAD = ("jax", "flax.linen", "optax", "tensorstore", "xlaopt.cli.train", "xlaopt.cli.programs",
           "xlaopt.runtime.train", "xlaopt.compile", "xlaopt.pipeline", "xlaopt.passes", "xlaopt.models",
           "xlaopt.checkpoint.local", "xlaopt.runtime.saving", "xlaopt.goodput.auto")
_PR_SET_NAME = 15


class ZygoteError(RuntimeError):
    pass


class Zygote:
    """The launcher's end: fork children, learn when they exit."""

    def __init__(self, env: dict[str, str]):
        read, write = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", "xlaopt.cli.zygote", str(write)],
                                        stdin=subprocess.PIPE, pass_fds=(write,), env=env, text=True)
        os.close(write)
        self._replies, self._pending = read, b""
        self.exited: dict[int, int] = {}

    def spawn(self, argv: list[str], env: dict[str, str], name: str) -> ForkedChild:
        """Fork a child running `xlaopt *argv` with `env` changed; it is called `name` in `ps`."""
        self.process.stdin.write(json.dumps({"argv": argv, "env": env, "name": name}) + "\n")
        self.process.stdin.flush()
        while True:
            for reply in self._read(timeout=None):
                if "started" in reply:
                    return ForkedChild(self, reply["started"])

    def poll(self, timeout: float = 0.0) -> None:
        """Take the replies that have come (waiting up to `timeout` for one)."""
        self._read(timeout)

    def _read(self, timeout: float | None) -> list[dict]:
        ready, _, _ = select.select([self._replies], [], [], timeout)
        if not ready:
            return []
        chunk = os.read(self._replies, 65536)
        if not chunk:
            raise ZygoteError(f"the job's zygote process exited ({self.process.wait()}); its error is above")
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        replies = [json.loads(line) for line in lines]
        self.exited.update((r["pid"], r["exit"]) for r in replies if "exit" in r)
        return replies

    def close(self) -> None:
        """No more children; the zygote exits once those it has exit."""
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.wait()
        os.close(self._replies)


class ForkedChild:
    """A zygote's child, with the part of `subprocess.Popen`'s interface a launcher uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.exited.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.poll()
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self.zygote.poll(timeout=1.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        # Not polled first: a signal handler calls this, perhaps while a poll is reading replies.
        if self.returncode is None:  # not reported exited, so the pid is still this child's
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def serve(replies: int) -> dict | None:
    """The zygote's loop; returns in a forked child with its request, or None when done."""
    for module in PRELOAD:
        __import__(module)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of exits
    # Ctrl-C reaches the whole process group: the launcher passes it on as SIGTERM to the children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests, pending, children, open_ = sys.stdin.fileno(), b"", set(), True

    def reply(**message) -> None:
        try:
            os.write(replies, (json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            pass  # the launcher is gone (killed): keep reaping until its children have exited

    while open_ or children:
        ready, _, _ = select.select([requests, wake_read] if open_ else [wake_read], [], [], 1.0)
        if wake_read in ready:
            os.read(wake_read, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            reply(pid=pid, exit=os.waitstatus_to_exitcode(status))
        if requests not in ready:
            continue
        chunk = os.read(requests, 65536)
        open_ = bool(chunk)
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become_child(request, (requests, replies, wake_read, wake_write))
                return request
            children.add(pid)
            reply(started=pid)
    return None


def _become_child(request: dict, fds: tuple[int, ...]) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for key, value in request["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _name_process(request["name"])


def job_processes(launcher_pid: int) -> dict[int, int]:
    """A launched job's running processes by process id (Linux): the children of the launcher's
    zygote, which names them `xlaopt-train-I`. For tools that signal one, as a fault injector does."""
    rows = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # a process that just exited
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # a child exited but not yet reaped is no process to signal
            rows.append((int(entry.name), int(fields[1]), name))
    zygotes = {pid for pid, ppid, _ in rows if ppid == launcher_pid}
    return {int(name.rsplit("-", 1)[1]): pid for pid, ppid, name in rows
            if ppid in zygotes and name.startswith("xlaopt-train-")}


def _name_process(name: str) -> None:
    """The name `ps -o comm` and `top` show (Linux, 15 bytes), so a job's processes tell apart."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass

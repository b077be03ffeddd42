"""The zygote a launched job's processes are forked from (xlaopt.runtime.zygote): a child runs
the `xlaopt` command line it was asked to, with its environment changes and its name, and its
exit status (a signal's as negative) comes back to the launcher."""
import os
import signal
import time

from xlaopt.errors import EXIT_USER_ERROR
from xlaopt.runtime.zygote import Zygote, job_processes

from conftest import command_env, free_port


def test_children_forked_from_the_zygote_run_their_command_and_report_their_exit(tmp_path):
    zygote = Zygote(command_env())
    try:
        # A bad input: the child's own `xlaopt` main runs, and exits 2 (its error on stderr).
        bad = zygote.spawn(["ckpt", "verify", str(tmp_path / "absent")], {}, "xlaopt-bad")
        assert bad.wait() == EXIT_USER_ERROR
        # A process of a job whose coordinator never comes waits to join: named, and killed.
        waiting = zygote.spawn(["train", "--model", "llama-tiny", "--mesh", "data=2", "--coordinator",
                                f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "1"],
                               {}, "xlaopt-train-1")
        deadline = time.monotonic() + 60
        while _name(waiting.pid) != "xlaopt-train-1" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _name(waiting.pid) == "xlaopt-train-1" and waiting.poll() is None
        assert job_processes(os.getpid()) == {1: waiting.pid}  # this test is the zygote's launcher
        waiting.kill()
        assert waiting.wait() == -signal.SIGKILL
    finally:
        zygote.close()
    assert zygote.process.returncode == 0


def test_a_zygote_whose_launcher_is_gone_waits_for_its_children_and_exits(tmp_path):
    """Its launcher killed, the zygote cannot report to it: it reaps its children as they exit
    (here killed by hand, as an operator would) and then exits cleanly, saying nothing."""
    zygote = Zygote(command_env())
    waiting = zygote.spawn(["train", "--model", "llama-tiny", "--mesh", "data=2", "--coordinator",
                            f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "1"], {}, "x")
    os.close(zygote._replies)  # as if the launcher had died: the reply pipe has no reader
    zygote.process.stdin.close()
    os.kill(waiting.pid, signal.SIGKILL)
    assert zygote.process.wait(timeout=60) == 0


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()

"""XLA's log lines are captured during a compile, not printed over a command's answer: what
matters becomes one note; `--verbose` lets them through; our own lines always go through."""
import dataclasses
import os

from xlaopt.compile import compile_program
from xlaopt.compiler import log as compiler_log
from xlaopt.models.registry import get_config
from xlaopt.program import TrainProgram
from xlaopt.transforms import HloTransform

# As XLA's C++ logging writes them: straight to descriptor 2, past Python's sys.stderr. (The
# deviceless GPU compile of llama3-8b on h100:1x8 logs these; the gpu-aot extra is not installable
# on every machine, so the lines are written here the way XLA writes them.)
XLA_LINES = (b"W1202 19:41:41.000000 1234 hlo_rematerialization.cc:3005] Can't reduce memory use below 70.00GiB "
             b"(75161927680 bytes) by rematerialization; only reduced to 71.20GiB\n"
             b"W1202 19:41:41.000001 1234 spmd_partitioner.cc:652] [spmd] Involuntary full rematerialization. "
             b"The compiler was not able to go from sharding {devices=[8,1]<=[8]} to {devices=[1,8]<=[8]}\n"
             b"W1202 19:41:41.000002 1234 spmd_partitioner.cc:652] [spmd] Involuntary full rematerialization. "
             b"The compiler was not able to go from sharding {devices=[8,1]<=[8]} to {replicated}\n")


def test_xla_lines_become_notes_and_ours_go_through(capfd):
    with compiler_log.captured() as log:
        os.write(2, XLA_LINES)
        os.write(2, b"xlaopt: warning: the compile cache's entry for x could not be read\n")
    err = capfd.readouterr().err
    assert "Involuntary" not in err and "Can't reduce" not in err
    assert err.splitlines() == ["xlaopt: warning: the compile cache's entry for x could not be read"]
    assert len(log.lines) == 3
    assert log.notes == [
        "XLA's rematerialization could not bring the step under its memory target (1 log line; --verbose shows them)",
        "XLA could reshard a tensor only by replicating it (SPMD involuntary full rematerialization) (2 log lines; "
        "--verbose shows them)"]


def test_verbose_shows_them_raw(capfd):
    compiler_log.show_raw(True)
    try:
        with compiler_log.captured() as log:
            os.write(2, XLA_LINES)
    finally:
        compiler_log.show_raw(False)
    assert capfd.readouterr().err.encode() == XLA_LINES and log.notes == []


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogsLikeXla(HloTransform):
    """Runs inside XLA's pipeline and writes to descriptor 2 there, as XLA's own passes log."""
    name = "logs-like-xla"

    def rewrite(self, module_proto):
        os.write(2, XLA_LINES)
        return None


def test_a_compile_reports_what_xla_logged_during_it(capfd):
    program = TrainProgram(get_config("llama-tiny", {"num_layers": 1}), hlo_transforms=(LogsLikeXla(),))
    compiled = compile_program(program)
    compiled.grads  # noqa: B018
    assert "Involuntary" not in capfd.readouterr().err
    assert [n.split(" (")[0] for n in compiled.compiler_notes] == [
        "XLA's rematerialization could not bring the step under its memory target",
        "XLA could reshard a tensor only by replicating it"]


def test_every_compiling_command_takes_the_verbose_its_notes_name(monkeypatch):
    import xlaopt.cli as cli

    seen = []
    monkeypatch.setattr(compiler_log, "show_raw", seen.append)
    for command in ("train", "verify", "analyze", "inspect", "plan"):
        monkeypatch.setitem(cli._COMMANDS, command, lambda args: 0)
        for verbose in (True, False):
            topology = ["--topology", "h100:1x8"] if command in ("analyze", "plan") else []
            assert cli.main([command, "--model", "llama-tiny", *topology, *(["--verbose"] if verbose else [])]) == 0
    assert seen == [True, False] * 5

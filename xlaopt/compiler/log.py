"""XLA's own log lines, captured during a compile instead of printed over a command's answer.

XLA's C++ logging writes straight to file descriptor 2 (a rematerialization that could not reach
its memory target, "SPMD Involuntary full rematerialization" with whole HLO instructions), so
Python cannot filter it: `captured` points descriptor 2 at a file for the compile and reads it
back. What matters in the lines becomes one note each (`notes`), for the command's report to name
beside the program; `--verbose` (`show_raw(True)`) writes them through as they were. Lines of
ours (`xlaopt: ...`, e.g. the compile cache's warning) always go through.

Only in a single-process run: in a multi-process job a watchdog thread may have to print its one
line while a compile runs, and that line must not land in the capture.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

_raw = False


def show_raw(on: bool = True) -> None:
    """Let XLA's log lines through as they are (the commands' `--verbose`)."""
    global _raw
    _raw = on


# (pattern in a log line, the note it becomes). One note per kind and compile.
_KINDS = (
    (re.compile(r"[Rr]ematerialization.*(could not|can't|cannot|unable)|Can't reduce memory use below"),
     "XLA's rematerialization could not bring the step under its memory target"),
    (re.compile(r"Involuntary full rematerialization"),
     "XLA could reshard a tensor only by replicating it (SPMD involuntary full rematerialization)"),
)


@dataclasses.dataclass
class CompilerLog:
    lines: list[str] = dataclasses.field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """One line for each kind of trouble XLA logged, with how often."""
        notes = []
        for pattern, note in _KINDS:
            count = sum(bool(pattern.search(line)) for line in self.lines)
            if count:
                notes.append(f"{note} ({count} log line{'s' if count > 1 else ''}; --verbose shows them)")
        return notes


@contextlib.contextmanager
def captured():
    """Descriptor 2 into a file while the block runs; yields the `CompilerLog` filled after it."""
    log = CompilerLog()
    if _raw or not _single_process():
        yield log
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
    ours = [line for line in text.splitlines() if line.startswith("xlaopt")]
    log.lines = [line for line in text.splitlines() if line.strip() and not line.startswith("xlaopt")]
    for line in ours:
        print(line, file=sys.stderr)


def _single_process() -> bool:
    from xlaopt.runtime import distributed

    return not distributed.joined()

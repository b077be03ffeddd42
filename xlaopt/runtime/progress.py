"""A one-line progress bar on stderr: redrawn in place on a terminal, a line per tenth otherwise."""
from __future__ import annotations

import sys


class ProgressBar:
    def __init__(self, total: int, width: int = 30, stream=None):
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, done: int, text: str) -> None:
        filled = self.width * done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r" + line)
            if done == self.total:
                self.stream.write("\n")
        elif done == self.total or done == 1 or done % max(self.total // 10, 1) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()

"""Peak resident memory over a block of code, sampled from /proc (Linux)."""
from __future__ import annotations

import os
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """`with PeakRss() as p: ...`; then `p.extra_bytes` = peak RSS above the RSS at entry."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.extra_bytes = interval_s, 0

    def __enter__(self):
        self._base = self._peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_bytes())
        self.extra_bytes = self._peak - self._base

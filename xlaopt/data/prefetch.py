"""Produce host batches on a background thread so the training step need not wait."""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

_DONE = object()


def prefetch(make: Callable[[int], object], count: int, depth: int = 2) -> Iterator:
    """Yield make(0), ..., make(count-1), computed ahead on a daemon thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)

    def work():
        try:
            for i in range(count):
                q.put(make(i))
        except BaseException as e:  # surface producer errors in the consumer
            q.put(e)
        q.put(_DONE)

    threading.Thread(target=work, daemon=True, name="xlaopt-prefetch").start()
    while (item := q.get()) is not _DONE:
        if isinstance(item, BaseException):
            raise item
        yield item

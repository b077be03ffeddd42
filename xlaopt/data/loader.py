"""Stream packed Cosmos 3 batches from a sample store: deterministic, resumable, prefetched.

Planning is global and cheap: from the store's index alone (token counts, no latent bytes)
every process computes the same sequence of global batches (a seeded permutation per
epoch, best-fit packing of samples into rows with a text budget and a generator budget;
a sample that fits no row yet waits, first in line, for the next batch). Reading is local:
each process reads only the samples of its own rows. The state after a batch is
(epoch, cursor, waiting samples, batches), the same on every process, so a run resumes on
the exact next sample, also on a different process count.

A background thread reads and packs ahead. Its window (batches in flight) starts at two
and grows while the consumer measurably waits, up to `max_prefetch`, sized by how long the
slowest (p95) batch takes to read against the step time.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time

import numpy as np

from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.packing import fill_row, logit_normal_sigma
from xlaopt.data.store import SampleStore
from xlaopt.errors import UserError
from xlaopt.models.cosmos3_config import Cosmos3Config

RESOLUTION_SHIFT = 3.0
_WINDOW = 1.5  # a batch is planned from samples holding 1.5x its token capacity


class LoaderError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class LoaderState:
    epoch: int = 0
    cursor: int = 0  # next position in this epoch's permutation
    waiting: tuple[int, ...] = ()  # sample ids planned but not yet placed, first in line
    batches: int = 0
    skipped: int = 0  # samples longer than the budget, skipped by choice

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"waiting": list(self.waiting)}

    @classmethod
    def from_json(cls, data: dict) -> "LoaderState":
        return cls(**{**data, "waiting": tuple(data.get("waiting", ()))})


class Planner:
    """Global batch plans from token counts alone; a pure function of (store, seed, state)."""

    def __init__(self, lengths: np.ndarray, shape: BatchShape, seed: int, skip_oversize: bool = False):
        self.lengths, self.shape, self.seed, self.skip_oversize = lengths, shape, seed, skip_oversize
        too_long = (lengths[:, 0] > shape.text_len) | (lengths[:, 1] > shape.gen_len)
        if too_long.any() and not skip_oversize:
            i = int(np.flatnonzero(too_long)[0])
            raise LoaderError(f"sample {i} has {lengths[i, 0]} text and {lengths[i, 1]} generator tokens, more "
                              f"than a row holds ({shape.text_len}, {shape.gen_len}) ({int(too_long.sum())} such "
                              f"samples); raise --text-len/--gen-len or skip them with skip_oversize=True")
        self._too_long = too_long
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))}
        return self._perm_cache[epoch]

    def _next(self, state: dict) -> int:
        while True:
            perm = self._perm(state["epoch"])
            if state["cursor"] >= len(perm):
                state["epoch"], state["cursor"] = state["epoch"] + 1, 0
                continue
            i = int(perm[state["cursor"]])
            state["cursor"] += 1
            if self._too_long[i]:
                state["skipped"] += 1
                continue
            return i

    def plan(self, state: LoaderState) -> tuple[list[list[int]], LoaderState]:
        """Rows of sample ids for the next global batch, and the state after it.

        The window is the waiting samples plus new ones until it holds `_WINDOW` times the
        batch's token capacity. Waiting samples are placed first (so none waits forever),
        then the rest largest first; each goes to the row whose free (text, generator)
        capacity points most its way (the dot-product rule for two-dimensional bins, which
        keeps text-heavy and generator-heavy samples from stranding each other's budget).
        What fits nowhere waits, in stream order, for the next batch."""
        B, T, V = self.shape.batch_size, self.shape.text_len, self.shape.gen_len
        s = dataclasses.asdict(state)
        window = list(state.waiting)
        n_waiting = len(window)
        tokens = int(self.lengths[window].sum()) if window else 0
        while tokens < _WINDOW * B * (T + V):
            i = self._next(s)
            window.append(i)
            tokens += int(self.lengths[i].sum())
        scale = np.array([T, V], np.float64)
        need = self.lengths[window] / scale
        order = sorted(range(len(window)), key=lambda k: (k >= n_waiting, -need[k].sum(), k))
        rows: list[list[int]] = [[] for _ in range(B)]
        free = np.array([[T, V]] * B, np.int64)
        placed = set()
        for k in order:
            left = free - self.lengths[window[k]]
            ok = (left >= 0).all(axis=1)
            if ok.any():
                row = int(np.argmax(np.where(ok, (free / scale) @ need[k], -np.inf)))
                rows[row].append(k)
                free[row] = left[row]
                placed.add(k)
        s["waiting"] = tuple(i for k, i in enumerate(window) if k not in placed)
        s["batches"] += 1
        # Within a row, samples keep stream order (packing order does not change the math).
        return [[window[k] for k in sorted(r)] for r in rows], LoaderState(**s)


def split_budget(row_tokens: int, mean_text: float, mean_gen: float) -> tuple[int, int]:
    """Text and generator budgets of a row in the ratio of the store's mean token counts."""
    text = max(1, round(row_tokens * mean_text / (mean_text + mean_gen)))
    return text, row_tokens - text


class Loader:
    """Iterator of host batches (this process's rows) from a sample store."""

    def __init__(self, store: SampleStore, config: Cosmos3Config, shape: BatchShape, seed: int = 0,
                 state: LoaderState | None = None, process_index: int = 0, process_count: int = 1,
                 skip_oversize: bool = False, max_prefetch: int = 16):
        if shape.batch_size % process_count:
            raise LoaderError(f"batch size {shape.batch_size} does not split over {process_count} processes")
        for modality, width in store.widths.items():
            if width > config.generator_in_dim:
                raise LoaderError(f"store {store.dir}: modality {modality} has width {width}, wider than "
                                  f"{config.name}'s generator input ({config.generator_in_dim})")
        self.store, self.config, self.shape, self.seed = store, config, shape, seed
        self.planner = Planner(store.lengths(), shape, seed, skip_oversize)
        rows = shape.batch_size // process_count
        self._rows = range(process_index * rows, (process_index + 1) * rows)
        self._local_shape = dataclasses.replace(shape, batch_size=rows)
        self._consumed = state or LoaderState()
        self.prefetch, self.max_prefetch = 2, max_prefetch
        self._fill_times: collections.deque = collections.deque(maxlen=64)
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, daemon=True, name="xlaopt-loader")
        self._thread.start()

    def state(self) -> LoaderState:
        """The state after the last batch handed out: save it with the checkpoint."""
        return self._consumed

    def _produce(self) -> None:
        state = self._consumed
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or len(self._queue) < self.prefetch)
                    if self._stop:
                        return
                t0 = time.perf_counter()
                rows, state = self.planner.plan(state)
                batch = self._read(rows, state)
                self._fill_times.append(time.perf_counter() - t0)
                with self._cv:
                    self._queue.append((batch, state))
                    self._cv.notify_all()
        except BaseException as e:  # surfaced by __next__
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _read(self, rows: list[list[int]], state: LoaderState) -> dict[str, np.ndarray]:
        out = {k: np.zeros(s, d) for k, (s, d, _) in cosmos3_batch_spec(self.config, self._local_shape).items()}
        for local, row in enumerate(self._rows):
            ids = rows[row]
            samples = self.store.read_many(ids)
            sigmas = [logit_normal_sigma(np.random.default_rng([self.seed, state.epoch, 1, i]), RESOLUTION_SHIFT)
                      for i in ids]
            fill_row(out, local, samples, sigmas, self.config)
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        with self._cv:
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: self._queue or self._error is not None)
            waited = time.perf_counter() - t0
            if self._error is not None:
                raise self._error
            batch, self._consumed = self._queue.popleft()
            if waited > 1e-3 and self.prefetch < self.max_prefetch:
                self.prefetch += 1  # the consumer waited: read further ahead
            self._cv.notify_all()
        return batch

    def size_window(self, step_time_s: float) -> int:
        """Prefetch window from the measured read-time distribution: enough batches in flight
        to cover the p95 read time at this step time, plus one."""
        if self._fill_times and step_time_s > 0:
            p95 = float(np.quantile(np.asarray(self._fill_times), 0.95))
            with self._cv:
                self.prefetch = int(min(self.max_prefetch, max(self.prefetch, math.ceil(p95 / step_time_s) + 1)))
                self._cv.notify_all()
        return self.prefetch

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

"""Stream packed Cosmos 3 batches from a sample store: deterministic, resumable, prefetched.

Planning is global and cheap: from the store's index alone (token counts, no latent bytes)
every process computes the same sequence of global batches (a seeded permutation per
epoch; rows with a text budget and a generator budget, each seeded with the oldest sample
of a lookahead window twice the batch's capacity and filled with the subset of the window
that fills it best; what no row took waits, first in line, for the next batch). Reading is local:
each process reads only the samples of its own rows. The state after a batch is
(epoch, cursor, waiting samples, batches), the same on every process, so a run resumes on
the exact next sample, also on a different process count.

A background thread reads and packs ahead. The reads of the next `read_ahead` batches are
queued while one is packed, so the disk does not idle at batch boundaries, and each clip is
read straight into its place in its batch. The window of packed batches starts at two and
grows while the consumer measurably waits, up to `max_prefetch`, sized by how long the
slowest (p95) batch takes to read against the step time.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import threading
import time

import numpy as np

from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.packing import fill_row, logit_normal_sigma
from xlaopt.data.store import SampleStore
from xlaopt.errors import UserError
from xlaopt.io.hostmem import BufferPool
from xlaopt.models.cosmos3_config import Cosmos3Config

RESOLUTION_SHIFT = 3.0
_WINDOW = 2.0  # a batch is planned from samples holding twice its text and its generator budget
_FILL_CELLS = 1 << 14  # largest (text x generator) table `best_fill` searches exactly


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


class BatchPacker:
    """Global batch plans from token counts alone; a pure function of (store, seed, state)."""

    def __init__(self, lengths: np.ndarray, shape: BatchShape, seed: int, skip_oversize: bool = False,
                 balance_groups: int = 1):
        """`balance_groups`: the batch's rows split into this many contiguous groups (the batch's
        shards over the mesh, see `balance_rows`); 1 keeps the packing order."""
        if balance_groups < 1 or shape.batch_size % balance_groups:
            raise LoaderError(f"{balance_groups} row groups do not split a batch of {shape.batch_size} rows")
        self.lengths, self.shape, self.seed, self.skip_oversize = lengths, shape, seed, skip_oversize
        self.balance_groups = balance_groups
        too_long = (lengths[:, 0] > shape.text_len) | (lengths[:, 1] > shape.gen_len)
        if too_long.all():
            raise LoaderError(f"no sample fits a row of ({shape.text_len}, {shape.gen_len}) text and generator "
                              f"tokens; {budget_hint(lengths, shape)}; raise --text-len/--gen-len")
        if too_long.any() and not skip_oversize:
            i = int(np.flatnonzero(too_long)[0])
            raise LoaderError(f"sample {i} has {lengths[i, 0]} text and {lengths[i, 1]} generator tokens, more "
                              f"than a row holds ({shape.text_len}, {shape.gen_len}) ({int(too_long.sum())} such "
                              f"samples; {tuple(int(x) for x in lengths.max(axis=0))} holds every sample); raise "
                              f"--text-len/--gen-len, or skip them (counted in the loader state) with --skip-oversize")
        self._too_long = too_long
        # A window holds `_WINDOW` batches' worth of text and of generator tokens; a mix short of
        # one kind stops it at 4x the samples that holds on average.
        mean = max(float(lengths[~too_long].sum(axis=1).mean()), 1.0)
        self._max_window = math.ceil(4 * _WINDOW * shape.tokens / mean)
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
        batch's text budget and its generator budget, in stream order (so the oldest first).
        Each row in turn is seeded with the oldest unplaced sample (so the head of the
        waiting line leaves with every batch, `batch_size` at a time, and none waits more
        than len(waiting) / batch_size batches), then filled by `best_fill`: the subset of
        the other unplaced samples that fills the row's (text, generator) room the most,
        exactly when one exists, preferring older samples. What no row took waits, in
        stream order, for the next batch."""
        B, T, V = self.shape.batch_size, self.shape.text_len, self.shape.gen_len
        s = dataclasses.asdict(state)
        window = list(state.waiting)
        want = _WINDOW * B * np.array([T, V])
        tokens = self.lengths[window].sum(axis=0)
        while (tokens < want).any() and len(window) < self._max_window:
            i = self._next(s)
            window.append(i)
            tokens = tokens + self.lengths[i]
        need = self.lengths[window]
        free = np.ones(len(window), bool)
        rows: list[list[int]] = []
        for _ in range(B):
            row: list[int] = []
            room = np.array([T, V], np.int64)
            if free.any():
                seed = int(np.argmax(free))  # the oldest unplaced sample fits an empty row
                row.append(seed)
                free[seed] = False
                room -= need[seed]
            candidates = np.flatnonzero(free & (need <= room).all(axis=1))
            picked = candidates[best_fill(need[candidates], room)]
            free[picked] = False
            # Within a row, samples keep stream order (packing order does not change the math).
            rows.append(sorted(row + picked.tolist()))
        s["waiting"] = tuple(window[k] for k in np.flatnonzero(free))
        s["batches"] += 1
        rows = [rows[i] for i in balance_rows([attention_pairs(need[r]) for r in rows], self.balance_groups)]
        return [[window[k] for k in r] for r in rows], LoaderState(**s)


def attention_pairs(need: np.ndarray) -> float:
    """(query, key) pairs the two-way mask lets a row of samples of [n, 2] (text, generator) tokens
    compute: each sample's causal text and its generator over all its tokens. What a row costs
    beyond its (equal) per-token work when attention skips what the mask forbids."""
    t, g = need[:, 0].astype(np.float64), need[:, 1].astype(np.float64)
    return float(np.sum(t * (t + 1) / 2 + g * (t + g)))


def balance_rows(costs, groups: int) -> list[int]:
    """An order of the rows whose `groups` contiguous groups (of equal row count: the batch's
    shards over the mesh, each a device's rows) hold near-equal total cost: rows by falling cost,
    each to the least loaded group with room (LPT). The step waits for the busiest device, so a
    batch of a few clip-heavy rows should not land them on one. groups=1 keeps the order."""
    if groups == 1:
        return list(range(len(costs)))
    size = len(costs) // groups
    members: list[list[int]] = [[] for _ in range(groups)]
    load = np.zeros(groups)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        open_ = [k for k in range(groups) if len(members[k]) < size]
        k = min(open_, key=lambda k: (load[k], k))
        members[k].append(i)
        load[k] += costs[i]
    return [i for group in members for i in sorted(group)]


def best_fill(need: np.ndarray, room: np.ndarray, max_cells: int = _FILL_CELLS) -> np.ndarray:
    """Indices of a subset of `need` ([n, 2] text and generator tokens, in order of
    preference) whose sums stay within `room` and fill it the most (in tokens).

    A 0/1 knapsack over the (text, generator) room: reach[t, g] holds the first candidate by
    which a subset summing to (t, g) was found, so walking back from the best cell gives a
    subset made of the earliest candidates that can reach it. A room of more than
    `max_cells` cells is first narrowed by taking candidates in order while they fit; if it
    is still too large, it is counted in coarser units (lengths rounded up, room rounded
    down), which keeps every subset within budget at the cost of exactness."""
    room = np.asarray(room, np.int64).copy()
    if len(need) == 0 or (room < 0).any():
        return np.zeros(0, np.int64)
    taken, rest = [], []
    for k in range(len(need)):
        if (room[0] + 1) * (room[1] + 1) > max_cells and (need[k] <= room).all():
            taken.append(k)
            room -= need[k]
        else:
            rest.append(k)
    rest = np.asarray(rest, np.int64)
    rt, rg = int(room[0]), int(room[1])
    qt = qg = 1
    if (rt + 1) * (rg + 1) > max_cells:  # split the cells between the axes in proportion to the room
        nt = int(min(rt + 1, max(2, math.sqrt(max_cells * (rt + 1) / (rg + 1)))))
        qt, qg = math.ceil((rt + 1) / nt), math.ceil((rg + 1) / max(2, max_cells // nt))
    size = -(-need[rest] // np.array([qt, qg]))  # lengths rounded up to whole units
    rt, rg = rt // qt, rg // qg
    reach = np.full((rt + 1, rg + 1), -1, np.int64)
    reach[0, 0] = len(rest)
    for k, (t, g) in enumerate(size.tolist()):
        if t > rt or g > rg:
            continue
        new = (reach[: rt + 1 - t, : rg + 1 - g] >= 0) & (reach[t:, g:] < 0)
        reach[t:, g:][new] = k
        if reach[rt, rg] >= 0:  # full: nothing fills it more
            break
    ts, gs = np.nonzero(reach >= 0)
    best = int(np.argmax(ts * qt + gs * qg))  # the most tokens
    cell = (int(ts[best]), int(gs[best]))
    while cell != (0, 0):
        k = int(reach[cell])
        taken.append(int(rest[k]))
        cell = (cell[0] - int(size[k, 0]), cell[1] - int(size[k, 1]))
    return np.asarray(sorted(taken), np.int64)


def budget_hint(lengths: np.ndarray, shape: BatchShape) -> str:
    """The budgets near `shape`'s that work for [n, 2] (text, generator) `lengths`: the least
    raise of it that holds some sample (the rest skipped), and the one that holds every sample."""
    need = np.maximum(lengths, [shape.text_len, shape.gen_len])
    least = tuple(int(x) for x in need[np.argmin(need.sum(axis=1))])
    every = tuple(int(x) for x in lengths.max(axis=0))
    if least == every:
        return f"the smallest budget that works is {every}, which holds every sample"
    return (f"the smallest budget that works is {least}, with --skip-oversize for the longer samples; "
            f"{every} holds every sample")


def split_budget(row_tokens: int, mean_text: float, mean_gen: float) -> tuple[int, int]:
    """Text and generator budgets of a row in the ratio of the store's mean token counts."""
    text = max(1, round(row_tokens * mean_text / (mean_text + mean_gen)))
    return text, row_tokens - text


class Loader:
    """Iterator of host batches (this process's rows) from a sample store."""

    def __init__(self, store: SampleStore, config: Cosmos3Config, shape: BatchShape, seed: int = 0,
                 state: LoaderState | None = None, process_index: int = 0, process_count: int = 1,
                 skip_oversize: bool = False, max_prefetch: int = 16, rows: range | None = None,
                 read_ahead: int = 2, balance_groups: int = 1):
        """This process reads the rows `rows` of every global batch (what its devices hold; see
        `CompiledProgram.local_rows`), by default its 1/process_count share in process order.
        `read_ahead`: batches whose reads are queued behind the one being packed. `balance_groups`:
        the batch's shards over the mesh, balanced for attention work (`balance_rows`)."""
        if rows is None and shape.batch_size % process_count:
            raise LoaderError(f"batch size {shape.batch_size} does not split over {process_count} processes")
        if rows is not None and not (rows.step == 1 and 0 <= rows.start < rows.stop <= shape.batch_size):
            raise LoaderError(f"rows {rows} are not a contiguous part of the {shape.batch_size} rows of a batch")
        for modality, width in store.widths.items():
            if width > config.generator_in_dim:
                raise LoaderError(f"store {store.dir}: modality {modality} has width {width}, wider than "
                                  f"{config.name}'s generator input ({config.generator_in_dim})")
        self.store, self.config, self.shape, self.seed = store, config, shape, seed
        self.packer = BatchPacker(store.lengths(), shape, seed, skip_oversize, balance_groups)
        if rows is None:
            share = shape.batch_size // process_count
            rows = range(process_index * share, (process_index + 1) * share)
        self._rows = rows
        self._local_shape = dataclasses.replace(shape, batch_size=len(rows))
        self._consumed = state or LoaderState()
        self.prefetch, self.max_prefetch = 2, max_prefetch
        self.read_ahead = read_ahead
        self._spec = cosmos3_batch_spec(config, self._local_shape)
        # Batches of clips are ~100 MB of latents, rewritten whole each step: reuse their memory.
        x0_shape, x0_dtype, _ = self._spec["gen_x0_BVC"]
        self._x0_pool = BufferPool((max_prefetch + read_ahead + 2) * math.prod(x0_shape) * x0_dtype.itemsize)
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
        # Reads run ahead of packing: while batch N is packed, the reads of the next `read_ahead`
        # batches are queued on the store's reader, so the disk does not idle at a batch
        # boundary, and every clip is read straight into its place in its batch (one copy).
        inflight: collections.deque = collections.deque()
        state = self._consumed
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or len(self._queue) < self.prefetch)
                    if self._stop:
                        return
                t0 = time.perf_counter()
                while len(inflight) <= self.read_ahead:
                    rows, state = self.packer.plan(state)
                    inflight.append(self._start(rows, state))
                rows, batch_state, out, pending = inflight.popleft()
                self._pack(out, rows, batch_state, pending.result())
                self._fill_times.append(time.perf_counter() - t0)
                with self._cv:
                    self._queue.append((out, batch_state))
                    self._cv.notify_all()
        except BaseException as e:  # surfaced by __next__
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _start(self, rows: list[list[int]], state: LoaderState) -> tuple:
        """A batch's buffers, and its samples' reads started into them."""
        out = {k: (self._x0_pool.empty(s, d) if k == "gen_x0_BVC" else np.zeros(s, d))
               for k, (s, d, _) in self._spec.items()}
        ids, into = [], []
        for local, row in enumerate(self._rows):
            g = 0
            for i in rows[row]:  # in the order `fill_row` packs them
                n = int(self.packer.lengths[i, 1])
                ids.append(i)
                into.append(out["gen_x0_BVC"][local, g:g + n] if n else None)
                g += n
        try:
            pending = self.store.start_many(ids, into)
        except Exception as e:  # this batch's error, raised when it is its turn: the ones before it are good
            pending = concurrent.futures.Future()
            pending.set_exception(e)
        return rows, state, out, pending

    def _pack(self, out: dict[str, np.ndarray], rows: list[list[int]], state: LoaderState, samples: list) -> None:
        samples = iter(samples)
        for local, row in enumerate(self._rows):
            ids = rows[row]
            sigmas = [logit_normal_sigma(np.random.default_rng([self.seed, state.epoch, 1, i]), RESOLUTION_SHIFT)
                      for i in ids]
            fill_row(out, local, [next(samples) for _ in ids], sigmas, self.config, latents_placed=True)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        with self._cv:
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: self._queue or self._error is not None)
            waited = time.perf_counter() - t0
            if not self._queue:  # the good batches made before an error are delivered first
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

"""Row ranges of the sample store's zarr3 arrays, read straight from their shard files.

The store's arrays (see `xlaopt.io.zarr3`) are zarr3 `sharding_indexed` files: inner chunks, each
its little-endian bytes followed by their crc32c (or bare, their crc32c in a side array), then
the shard index ((offset, nbytes) per inner chunk, uint64 little-endian) and its own crc32c at
the end of the file. Reading rows is thus: the index once per file, then one positioned read
per run of consecutive inner chunks, a hardware crc32c per inner chunk, and one copy of the
wanted rows into the result. Bare chunks wholly inside the rows asked for skip that copy when
the destination allows it (contiguous rows, file offset and address on the 512-byte grid of
direct I/O): the disk writes them straight into place, e.g. a clip's slice of a packed batch,
and they are checked there.

Why not tensorstore's read: on this 2-core host it spends ~1.6 CPU-ns per byte of multi-MB
video latents (a page-cache copy, its decode copy, its crc32c, 4 KiB page faults on its
results), so it tops out near 0.9 GB/s cold, and ~0.7 GB/s from a warm page cache, while the
disk gives ~2 GB/s to parallel direct reads. Here the disk writes into reused page-aligned
buffers with O_DIRECT (no page-cache copy or bookkeeping), several 4 MiB pieces of a read are
in flight at once (this virtio disk gives ~0.4 GB/s to 1 MiB reads, ~2 GB/s to 4 MiB ones
8 deep), and the CPU checksums and copies each byte once (~0.65 CPU-ns per byte, measured with
`xlaopt.benchmarks.data_io`), or only checksums them where they land. Tensorstore stays the
writer, and plain tensorstore reads the same files.

Every inner chunk's crc32c is checked and so is the shard index's; a mismatch, a truncated
file, a missing file or an index pointing outside its file raises `ShardError` naming the
file. Files are assumed immutable while a reader has them open (a store is write-once).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import threading
import time

import google_crc32c
import numpy as np

from xlaopt.errors import UserError
from xlaopt.io.crc32c import CODECS as _CRC, chunk_crc32c
from xlaopt.io.direct import DIRECT_ALIGN, DirectFile, ShortRead
from xlaopt.io.hostmem import BufferPool
from xlaopt.io.zarr3 import read_chunk_checksums

THREADS = 8  # pieces in flight: the disk's queue depth, measured (see `xlaopt.benchmarks.data_io`)
PIECE_BYTES = 4 << 20  # one positioned read: large enough to stream, small enough to spread
POOL_BYTES = 512 << 20  # freed result buffers kept for reuse
# Smaller reads go through the page cache: O_DIRECT would send every re-read of a small sample
# (text, actions, a toy store read epoch after epoch) to the disk, ~20x slower than the cache.
DIRECT_MIN_BYTES = 1 << 20
_MISSING = (1 << 64) - 1  # an inner chunk the shard does not hold


class ShardError(UserError):
    pass


class _Array:
    """What a row read needs from one array's zarr.json: the layout `xlaopt.io.zarr3` writes,
    and nothing else (other codecs raise, so a caller can fall back to tensorstore)."""

    def __init__(self, path: pathlib.Path):
        meta_path = path / "zarr.json"
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise ShardError(f"{meta_path} is missing") from None
        except json.JSONDecodeError as e:
            raise ShardError(f"{meta_path}: unreadable ({e})") from None
        self.path = path
        self.shape = tuple(int(d) for d in meta["shape"])
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        outer = [int(d) for d in meta["chunk_grid"]["configuration"]["chunk_shape"]]
        codecs = meta.get("codecs", [])
        encoding = meta.get("chunk_key_encoding", {"name": "default"})
        inner_codecs = _normal(codecs[0]["configuration"].get("codecs")) if len(codecs) == 1 else None
        sharded = (len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed" and inner_codecs in (_CRC, _CRC[:1])
                   and _normal(codecs[0]["configuration"].get("index_codecs")) == _CRC
                   and codecs[0]["configuration"].get("index_location", "end") == "end")
        if (not sharded or meta["chunk_grid"].get("name") != "regular" or encoding.get("name") != "default"
                or encoding.get("configuration", {}).get("separator", "/") != "/" or not self.shape):
            raise ShardError(f"{meta_path}: not the sharded crc32c layout this reader knows "
                             f"(read it with tensorstore)")
        inner = [int(d) for d in codecs[0]["configuration"]["chunk_shape"]]
        if list(self.shape[1:]) != outer[1:] or outer[1:] != inner[1:] or outer[0] % inner[0]:
            raise ShardError(f"{meta_path}: chunks split rows across files or chunks ({outer}, inner {inner}); "
                             f"this reader reads whole-row chunks only")
        self.outer_rows, self.inner_rows = outer[0], inner[0]
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.per_shard = self.outer_rows // self.inner_rows  # inner chunks per file
        self.chunk_bytes = self.inner_rows * self.row_bytes
        # Inner chunks end in their crc32c, or are bare bytes with their crc32c in a side array.
        self.crc: np.ndarray | None = None
        if inner_codecs == _CRC[:1]:
            chunks = -(-self.shape[0] // self.inner_rows)
            try:
                self.crc = np.asarray(read_chunk_checksums(path), np.uint32)
            except ValueError as e:
                raise ShardError(f"{path}: its inner chunks' crc32c side array is missing or damaged ({e})") from None
            if self.crc.shape != (chunks,):
                raise ShardError(f"{path}: its crc32c side array holds {self.crc.shape} entries, expected "
                                 f"({chunks},), one per inner chunk")
        self.stride = self.chunk_bytes + (4 if self.crc is None else 0)  # an inner chunk's bytes in the file

    def file(self, outer_index: int) -> pathlib.Path:
        return self.path.joinpath("c", str(outer_index), *["0"] * (len(self.shape) - 1))

    def shard_key(self, outer_index: int) -> tuple[str, int]:
        """A cheap key for one shard file (building its path costs more than a small read)."""
        return str(self.path), outer_index


def _normal(codecs):
    """Codec lists as tensorstore writes them, with the bytes codec's default endianness spelled."""
    out = []
    for c in codecs or []:
        c = {"name": c["name"], **({"configuration": c["configuration"]} if c.get("configuration") else {})}
        if c["name"] == "bytes":
            c["configuration"] = {"endian": c.get("configuration", {}).get("endian", "little")}
        out.append(c)
    return out


class _Shard:
    """One open shard file (a `DirectFile`: O_DIRECT for large reads, the page cache for small
    ones) and its verified index."""

    def __init__(self, path: pathlib.Path, array: _Array, direct: bool):
        self.path = path
        try:
            self.file = DirectFile(path, direct, min_direct_bytes=DIRECT_MIN_BYTES)
        except FileNotFoundError:
            raise ShardError(f"shard file {path} is missing") from None
        try:
            self._load_index(array)
        except BaseException:
            self.close()
            raise

    @property
    def direct(self) -> bool:
        return self.file.direct

    def close(self) -> None:
        self.file.close()

    def _load_index(self, array: _Array) -> None:
        size, path = self.file.size(), self.path
        index_bytes = 16 * array.per_shard + 4
        if size < index_bytes:
            raise ShardError(f"shard file {path} holds {size} bytes, less than its index ({index_bytes}): truncated")
        raw, _ = self.pread(size - index_bytes, index_bytes)
        index, stored = raw[:-4], int.from_bytes(raw[-4:].tobytes(), "little")
        if google_crc32c.value(index) != stored:
            raise ShardError(f"shard file {path}: crc32c mismatch in the shard index (truncated or corrupted)")
        entries = index.copy().view("<u8").reshape(array.per_shard, 2)
        self.offsets, self.nbytes = entries[:, 0].copy(), entries[:, 1].copy()
        present = self.offsets != _MISSING
        want, data_end = array.stride, size - index_bytes
        bad = present & ((self.nbytes != want) | (self.offsets > data_end) | (self.offsets + self.nbytes > data_end))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ShardError(f"shard file {path}: inner chunk {k} at {self.offsets[k]} of {self.nbytes[k]} bytes, "
                             f"expected {want} bytes within the file's {data_end} data bytes (truncated or "
                             f"corrupted)")

    def pread(self, offset: int, length: int, buf: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`DirectFile.pread`: bytes [offset, offset + length) and the aligned buffer holding them."""
        try:
            return self.file.pread(offset, length, buf)
        except ShortRead as e:
            raise self._truncated(e) from None

    def pread_into(self, offset: int, dest: np.ndarray) -> None:
        """`DirectFile.pread_into`: bytes [offset, offset + len(dest)) straight into `dest`."""
        try:
            self.file.pread_into(offset, dest)
        except ShortRead as e:
            raise self._truncated(e) from None

    def _truncated(self, e: ShortRead) -> ShardError:
        return ShardError(f"shard file {self.path}: {e.missing} bytes short at offset {e.offset} (truncated)")


def _copy_rows(dst: np.ndarray, src: np.ndarray, at: int, lo: int, hi: int) -> None:
    """dst[at:at + hi - lo] = rows lo:hi of `src` ([chunks, rows per chunk, ...]), whose chunks
    are not evenly spaced in memory: partial chunks at the ends, whole ones as one 3-D copy."""
    n = src.shape[1]
    while lo < hi and (lo % n or hi - lo < n):  # a head (or the only) partial chunk
        end = min(hi, (lo // n + 1) * n)
        dst[at:at + end - lo] = src[lo // n, lo % n:lo % n + end - lo]
        at, lo = at + end - lo, end
    whole = (hi - lo) // n
    if whole:  # splitting dst's first axis is always a view: this writes into dst
        dst[at:at + whole * n].reshape(whole, n, *dst.shape[1:])[...] = src[lo // n:lo // n + whole]
        at, lo = at + whole * n, lo + whole * n
    if lo < hi:
        dst[at:at + hi - lo] = src[lo // n, :hi - lo]


class RowsRead:
    """A read in flight; `result()` waits for it: the rows, or the first piece's error."""

    def __init__(self, out: np.ndarray, pieces: list[concurrent.futures.Future]):
        self._out, self._pieces = out, pieces

    def result(self) -> np.ndarray:
        for p in self._pieces:
            p.result()
        return self._out


class ShardReader:
    """Row ranges of zarr3 arrays laid out as `xlaopt.io.zarr3.array_spec` writes them with inner
    chunks (the sample store's arrays), read in parallel pieces on a thread pool.

        reader = ShardReader()
        rows = reader.read(store_dir / "shard-00000" / "video", 120, 4_000).result()

    `direct=False` reads through the page cache (a warm cache then serves repeated reads).
    `stats` sums, over all threads, the bytes read from disk and the seconds spent in reads,
    in checksums and in copies: where a pass spent its time."""

    def __init__(self, threads: int = THREADS, piece_bytes: int = PIECE_BYTES, direct: bool = True,
                 pool_bytes: int = POOL_BYTES):
        self.piece_bytes, self.direct = piece_bytes, direct
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="xlaopt-shard-read")
        self._arrays: dict[str, _Array] = {}
        self._shards: dict[tuple[str, int], _Shard] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._buffers = BufferPool(pool_bytes)
        self.stats = {"bytes": 0, "direct_bytes": 0, "pieces": 0, "read_s": 0.0, "crc_s": 0.0, "copy_s": 0.0}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for shard in self._shards.values():
                shard.close()
            self._shards.clear()
        self._buffers.clear()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def array_shape(self, path: str | os.PathLike) -> tuple[int, ...]:
        return self._array(path).shape

    def _array(self, path: str | os.PathLike) -> _Array:
        key = os.fspath(path)
        with self._lock:
            if key not in self._arrays:
                self._arrays[key] = _Array(pathlib.Path(path))
            return self._arrays[key]

    def _shard(self, array: _Array, outer_index: int) -> _Shard:
        key = array.shard_key(outer_index)
        with self._lock:  # opened once, its index read and checked once
            if key not in self._shards:
                self._shards[key] = _Shard(array.file(outer_index), array, self.direct)
            return self._shards[key]

    def read(self, path: str | os.PathLike, start: int, stop: int, out: np.ndarray | None = None) -> RowsRead:
        """Start reading rows [start, stop) of the array at `path` (its directory); returns at
        once. `out`: where to put them (shape [stop - start, *row shape], any strides: e.g. rows
        of a packed batch), else a new page-aligned array. Errors (ShardError naming the file)
        surface from `result()`, except a bad array, row range or `out`, which raise here."""
        array = self._array(path)
        if not 0 <= start <= stop <= array.shape[0]:
            raise ShardError(f"{array.path}: rows {start}:{stop} outside 0:{array.shape[0]}")
        shape = (stop - start, *array.row_shape)
        if out is None:
            out = self._buffers.empty(shape, array.dtype)
        elif out.shape != shape or out.dtype != array.dtype:
            raise ShardError(f"{array.path}: rows {start}:{stop} need an output of shape {shape} and dtype "
                             f"{array.dtype}, got {out.shape} {out.dtype}")
        pieces = []
        per_piece = max(1, self.piece_bytes // array.stride)
        first, last = start // array.inner_rows, -(-stop // array.inner_rows)  # inner chunks, end exclusive
        if (last - first) * array.stride < DIRECT_MIN_BYTES:
            # A small read (served by the page cache) costs less than handing it to a thread.
            done = concurrent.futures.Future()
            try:
                self._read_piece(array, first, last, start, stop, out)
                done.set_result(None)
            except Exception as e:  # surfaces from result(), as a threaded read's would
                done.set_exception(e)
            return RowsRead(out, [done])
        for k0 in range(first, last, per_piece):
            pieces.append(self._pool.submit(self._read_piece, array, k0, min(last, k0 + per_piece), start, stop, out))
        return RowsRead(out, pieces)

    def _read_piece(self, array: _Array, k0: int, k1: int, start: int, stop: int, out: np.ndarray) -> None:
        """Inner chunks [k0, k1) (numbered across the array's files): read each run of them that
        lies consecutively in one file, check every chunk's crc32c, and put its rows in [start,
        stop) into `out`: straight from the disk where they can be (`_direct_span`), else read
        into a buffer and copied."""
        runs = []  # (shard, first inner chunk in its file, chunks, first chunk's global number)
        for outer in range(k0 // array.per_shard, (k1 - 1) // array.per_shard + 1):  # usually one file
            shard = self._shard(array, outer)
            base = outer * array.per_shard
            lo, hi = max(k0, base) - base, min(k1, base + array.per_shard) - base
            offsets = shard.offsets[lo:hi]
            if (missing := np.flatnonzero(offsets == _MISSING)).size:
                raise ShardError(f"shard file {shard.path}: inner chunk {lo + int(missing[0])} is missing from the "
                                 f"shard (the store writes every chunk: the file is damaged)")
            # A run ends where the next chunk does not follow on disk (tensorstore writes them in order).
            cuts = [0, *(np.flatnonzero(np.diff(offsets) != array.stride) + 1).tolist(), hi - lo]
            runs += [(shard, lo + a, b - a, base + lo + a) for a, b in zip(cuts, cuts[1:])]
        t = {"read_s": 0.0, "crc_s": 0.0, "copy_s": 0.0, "direct_bytes": 0}
        for shard, local, count, k in runs:
            a, b = self._direct_span(array, shard, local, count, k, start, stop, out)
            for lo, hi, direct in ((k, a, False), (a, b, True), (b, k + count, False)):
                if hi > lo:
                    self._read_run(array, shard, local + lo - k, hi - lo, lo, start, stop, out, direct, t)
        with self._lock:
            s = self.stats
            s["bytes"] += sum(r[2] for r in runs) * array.stride
            s["pieces"] += 1
            for key, value in t.items():
                s[key] += value

    @staticmethod
    def _direct_span(array: _Array, shard: _Shard, local: int, count: int, k: int, start: int, stop: int,
                     out: np.ndarray) -> tuple[int, int]:
        """The chunks [a, b) of a run (global numbers [k, k + count)) that the disk can write
        straight into `out`: whole chunks within rows [start, stop), bare bytes (their crc32c in
        the side array), their rows contiguous in `out`, and file offset, address and length
        all whole blocks for direct I/O. None (an empty span at the run's end) otherwise."""
        n = array.inner_rows
        a, b = max(k, -(-start // n)), min(k + count, stop // n)
        none = (k + count, k + count)
        if (array.crc is None or not shard.direct or (b - a) * array.chunk_bytes < DIRECT_MIN_BYTES
                or array.chunk_bytes % DIRECT_ALIGN or int(shard.offsets[local + a - k]) % DIRECT_ALIGN):
            return none
        dest = out[a * n - start:b * n - start]
        if not dest.flags.c_contiguous or dest.ctypes.data % DIRECT_ALIGN:
            return none
        return a, b

    def _read_run(self, array: _Array, shard: _Shard, local: int, count: int, k: int, start: int, stop: int,
                  out: np.ndarray, direct: bool, t: dict) -> None:
        """`count` chunks consecutive in `shard` from its chunk `local` (global number `k`): read,
        checked, and their rows in [start, stop) placed in `out`."""
        n, offset = array.inner_rows, int(shard.offsets[local])
        t0 = time.perf_counter()
        if direct:  # `_direct_span` checked that these rows are whole chunks, contiguous and aligned
            rows = out[k * n - start:(k + count) * n - start]
            shard.pread_into(offset, rows.reshape(-1).view(np.uint8))
            chunks = rows.reshape(-1).view(np.uint8).reshape(count, array.chunk_bytes)
            t["direct_bytes"] += count * array.chunk_bytes
        else:
            # One buffer per thread, reused: fresh memory costs page faults at about the disk's rate.
            data, self._local.buf = shard.pread(offset, count * array.stride, getattr(self._local, "buf", None))
            chunks = data.reshape(count, array.stride)
        t1 = time.perf_counter()
        stored = (array.crc[k:k + count] if array.crc is not None
                  else chunks[:, array.chunk_bytes:].copy().view("<u4")[:, 0])
        computed = chunk_crc32c(chunks[:, :array.chunk_bytes])
        if (bad := np.flatnonzero(stored != computed)).size:
            j = int(bad[0])
            at = int(shard.offsets[local + j])
            raise ShardError(f"shard file {shard.path}: crc32c mismatch in inner chunk {local + j} "
                             f"(bytes {at}..{at + array.stride}); the file is corrupted")
        t2 = time.perf_counter()
        if not direct:
            # The run's rows as a [chunks, rows, ...] view skipping any crc32c words: one copy.
            rows = chunks[:, :array.chunk_bytes].view(array.dtype).reshape(count, n, *array.row_shape)
            row = k * n
            _copy_rows(out, rows, max(row, start) - start, max(start - row, 0), min(stop - row, count * n))
        t["read_s"] += t1 - t0
        t["crc_s"] += t2 - t1
        t["copy_s"] += time.perf_counter() - t2

"""A sample store on tensorstore: jagged multimodal samples as flat zarr3 arrays plus offsets.

Layout (open: tensorstore or zarr-python read it without xlaopt):

    DIR/manifest.json                 format, widths, shards, length statistics
    DIR/shard-00000/text              int32   [text tokens of the shard]
    DIR/shard-00000/video             float32 [video tokens, video width]
    DIR/shard-00000/action            float32 [action tokens, action width]
    DIR/shard-00000/sound             float32 [sound tokens, sound width]
    DIR/shard-00000/video_crc32c      uint32  [inner chunks of video] (and action_, sound_crc32c)
    DIR/shard-00000/index             int64   [samples, 9]: text start, text end, latent start,
                                      latent end (in the sample's modality array), modality,
                                      domain, n_clean, the grid packed as t*2^40 + h*2^20 + w,
                                      and the clip's frame rate in millihertz (0: unstated)

Every array is one zarr3 file per shard (sharding codec) of crc32c-checked inner chunks, so a
corrupted or truncated shard fails loudly, naming the file. The latent arrays' inner chunks are
bare bytes sized to whole 4 KiB pages, their crc32c kept in a side array
(`xlaopt.io.zarr3.chunk_checksums_path`): a clip is then one contiguous range of the file, which the
disk writes straight into the clip's place in a batch, and the checksum is checked there. Plain
tensorstore still reads every array; only the side arrays' check is xlaopt's. The manifest is written
last, via a temporary name and a rename: a store without one is incomplete.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Iterable

import numpy as np
import tensorstore as ts

from xlaopt.data.sample import MODALITY_NAMES, TEXT_ONLY, Sample, SampleError
from xlaopt.data.shard_reader import DIRECT_MIN_BYTES, ShardError, ShardReader
from xlaopt.errors import UserError
from xlaopt.io.crc32c import chunk_crc32c
from xlaopt.io.hostmem import PAGE
from xlaopt.io.zarr3 import array_spec, chunk_checksums_path, open_spec, read_chunk_checksums
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO

FORMAT = "xlaopt-sample-store"
VERSION = 3  # 2: the index gained the frame-rate column; 3: latents' crc32c in side arrays
LATENT_ARRAYS = {VIDEO: "video", ACTION: "action", SOUND: "sound"}
_INNER_BYTES = 256 << 10  # inner chunk: a random sample read touches few of them
_MIN_INNER_BYTES = 4 << 10  # latents: inner chunks near a sample's size, checked whole on every read
_GRID_BITS = 20
_INDEX_COLUMNS = 9


class StoreError(UserError):
    pass


def _array_spec(path: pathlib.Path, shape: tuple[int, ...], dtype: str, inner_bytes: int = _INNER_BYTES,
                inner_checksums: bool = True) -> dict:
    row_bytes = max(int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize, 1)
    inner = max(1, inner_bytes // row_bytes)
    # Whole pages per inner chunk where rows allow it (768-byte rows: 16 at a time), so every
    # chunk starts on a page boundary of the file, as direct I/O into a batch needs.
    unit = PAGE // math.gcd(row_bytes, PAGE)
    if unit * row_bytes <= 2 * _INNER_BYTES:
        inner = max(unit, inner // unit * unit)
    outer = max(inner, -(-max(shape[0], 1) // inner) * inner)  # a multiple of inner covering every row
    return array_spec(path, shape, dtype, chunk=[outer, *shape[1:]], inner=[inner, *shape[1:]],
                      inner_checksums=inner_checksums)


class StoreWriter:
    """Writes samples into shards of about `shard_bytes`; `close()` writes the manifest."""

    def __init__(self, directory: str | os.PathLike, widths: dict[int, int], shard_bytes: int = 64 << 20):
        self.dir = pathlib.Path(directory)
        if (self.dir / "manifest.json").exists():
            raise StoreError(f"{self.dir} already holds a sample store; pick an empty directory")
        if self.dir.exists() and not self.dir.is_dir():
            raise StoreError(f"{self.dir} is a file, not a directory; pick a new or empty directory for the store")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot make the store directory {self.dir}: {e.strerror}") from None
        self.widths, self.shard_bytes = dict(widths), shard_bytes
        self._pending: list[Sample] = []
        self._pending_bytes = 0
        self._shards: list[dict] = []
        self._lengths: list[tuple[int, int, int]] = []  # (modality, n_text, n_gen)

    def add(self, sample: Sample) -> None:
        where = f"sample {len(self._lengths)}"
        sample.validate(where)
        if sample.modality != TEXT_ONLY and sample.latents.shape[1] != self.widths[sample.modality]:
            raise SampleError(f"{where}: {MODALITY_NAMES[sample.modality]} width {sample.latents.shape[1]}, "
                              f"the store holds width {self.widths[sample.modality]}")
        self._pending.append(sample)
        self._pending_bytes += sample.text.nbytes + (0 if sample.latents is None else sample.latents.nbytes)
        self._lengths.append((sample.modality, sample.n_text, sample.n_gen))
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def add_all(self, samples: Iterable[Sample]) -> "StoreWriter":
        for s in samples:
            self.add(s)
        return self

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self._shards):05d}"
        path = self.dir / name
        samples, self._pending, self._pending_bytes = self._pending, [], 0
        index = np.zeros((len(samples), _INDEX_COLUMNS), np.int64)
        text = np.concatenate([s.text for s in samples]).astype(np.int32)
        latents = {m: [] for m in LATENT_ARRAYS}
        t_pos, l_pos = 0, {m: 0 for m in LATENT_ARRAYS}
        for i, s in enumerate(samples):
            start = l_pos.get(s.modality, 0)
            if s.modality != TEXT_ONLY:
                latents[s.modality].append(s.latents.astype(np.float32))
                l_pos[s.modality] += s.n_gen
            t, h, w = s.grid
            index[i] = (t_pos, t_pos + s.n_text, start, start + s.n_gen, s.modality, s.domain, s.n_clean,
                        (t << 2 * _GRID_BITS) | (h << _GRID_BITS) | w, round((s.fps or 0) * 1000))
            t_pos += s.n_text
        writes = [self._write(path / "text", text), self._write(path / "index", index)]
        for m, array_name in LATENT_ARRAYS.items():
            data = np.concatenate(latents[m]) if latents[m] else np.zeros((0, self.widths[m]), np.float32)
            writes += self._write_latents(path / array_name, data, [len(x) for x in latents[m]])
        for w in writes:
            w.result()
        self._shards.append({"name": name, "num_samples": len(samples)})

    @staticmethod
    def _write(path: pathlib.Path, data: np.ndarray):
        array = ts.open(_array_spec(path, data.shape, data.dtype.name)).result()
        return array.write(data)

    @staticmethod
    def _write_latents(path: pathlib.Path, data: np.ndarray, lengths: list[int]) -> list:
        """A latent array of bare inner chunks about the size of its median sample (so a read
        checks little beyond its sample), and the side array of their crc32c."""
        row_bytes = max(data.shape[1] * data.itemsize, 1)
        median = int(np.median(lengths)) * row_bytes if lengths else _INNER_BYTES
        inner_bytes = min(_INNER_BYTES, max(_MIN_INNER_BYTES, 1 << max(median - 1, 1).bit_length()))
        spec = _array_spec(path, data.shape, data.dtype.name, inner_bytes, inner_checksums=False)
        inner = spec["metadata"]["codecs"][0]["configuration"]["chunk_shape"][0]
        whole = len(data) // inner
        tail = np.zeros((inner if len(data) % inner else 0, *data.shape[1:]), data.dtype)
        tail[:len(data) % inner] = data[whole * inner:]  # the last chunk's rows past the end are zeros
        parts = (np.ascontiguousarray(data[:whole * inner]), tail)
        crc = np.concatenate([chunk_crc32c(p.view(np.uint8).reshape(-1, inner * row_bytes)) for p in parts])
        crc_spec = array_spec(chunk_checksums_path(path), crc.shape, "uint32", chunk=[max(len(crc), 1)])
        return [ts.open(spec).result().write(data), ts.open(crc_spec).result().write(crc)]

    def close(self) -> dict:
        self._flush()
        if not self._shards:
            raise StoreError(f"{self.dir}: no samples were written; an empty store is not a store")
        manifest = {"format": FORMAT, "version": VERSION,
                    "num_samples": sum(s["num_samples"] for s in self._shards),
                    "widths": {MODALITY_NAMES[m]: w for m, w in self.widths.items()},
                    "shards": self._shards, "stats": length_stats(np.asarray(self._lengths, np.int64))}
        tmp = self.dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, self.dir / "manifest.json")
        return manifest


def length_stats(lengths: np.ndarray) -> dict:
    """Per-sample token counts: quantiles of text, generator and total tokens, modality counts."""
    def quantiles(x):
        return {"mean": float(x.mean()), "p50": float(np.quantile(x, 0.5)), "p90": float(np.quantile(x, 0.9)),
                "p99": float(np.quantile(x, 0.99)), "max": int(x.max())}
    modality, n_text, n_gen = lengths.T
    return {"text_tokens": quantiles(n_text), "gen_tokens": quantiles(n_gen), "tokens": quantiles(n_text + n_gen),
            "modalities": {MODALITY_NAMES[m]: int((modality == m).sum()) for m in MODALITY_NAMES}}


class SampleStore:
    """Random access to the samples of a store directory. Reads of 1 MiB and more go straight to
    the shard files (`xlaopt.data.shard_reader`: parallel O_DIRECT reads, crc32c checked), which
    keeps a loader of large samples disk bound; smaller ones, and all with `direct=False`, go
    through tensorstore.
    `reader`: a reader of one's own (thread count, piece size), e.g. for a benchmark."""

    def __init__(self, directory: str | os.PathLike, direct: bool = True, reader: ShardReader | None = None):
        self.dir = pathlib.Path(directory)
        manifest_path = self.dir / "manifest.json"
        if not self.dir.is_dir():
            raise StoreError(f"sample store {self.dir} does not exist; make one with `xlaopt data make {self.dir}`")
        if not manifest_path.is_file():
            raise StoreError(f"{self.dir} has no manifest.json: not a sample store, or an interrupted write")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreError(f"{manifest_path}: unreadable manifest ({e})") from None
        except OSError as e:
            raise StoreError(f"{manifest_path}: cannot read the manifest: {e.strerror}") from None
        if not isinstance(self.manifest, dict):
            raise StoreError(f"{manifest_path}: not a manifest (a JSON object); the store is damaged")
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise StoreError(f"{manifest_path}: format {self.manifest.get('format')!r} version "
                             f"{self.manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}; an "
                             f"older store is written again from its source (`xlaopt data make` for a "
                             f"synthetic one)")
        self.widths, self._shards, starts = _check_manifest(self.manifest, manifest_path), [], [0]
        for shard in self.manifest["shards"]:
            self._shards.append(shard["name"])
            starts.append(starts[-1] + shard["num_samples"])
        self._starts = np.asarray(starts)
        self._arrays: dict[tuple[str, str], ts.TensorStore] = {}
        self._index: dict[str, np.ndarray] = {}
        self._checksums: dict[tuple[str, str], np.ndarray] = {}
        self._reader = (reader or ShardReader()) if direct else None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _array(self, shard: str, name: str) -> ts.TensorStore:
        key = (shard, name)
        if key not in self._arrays:
            path = self.dir / shard / name
            if not (path / "zarr.json").is_file():
                raise StoreError(f"sample store {self.dir}: array {shard}/{name} is missing")
            self._arrays[key] = ts.open(open_spec(path)).result()
        return self._arrays[key]

    def _shard_index(self, shard: str) -> np.ndarray:
        if shard not in self._index:
            n = self._array(shard, "index").shape[0]
            self._index[shard] = self._finish_read(self._start_read(shard, "index", 0, n))
        return self._index[shard]

    def lengths(self) -> np.ndarray:
        """[samples, 2] text and generator token counts, from the shard indexes alone."""
        return self.shapes()[:, 1:3]

    def shapes(self) -> np.ndarray:
        """[samples, 4] (modality, n_text, n_gen, n_clean) of every sample, from the shard indexes
        alone: what packing and pricing need, no latent read."""
        parts = []
        for shard in self._shards:
            index = self._shard_index(shard)
            parts.append(np.stack([index[:, 4], index[:, 1] - index[:, 0], index[:, 3] - index[:, 2], index[:, 6]],
                                  axis=1))
        return np.concatenate(parts).astype(np.int64)

    def read(self, i: int) -> Sample:
        return self.read_many([i])[0]

    def read_many(self, ids) -> list[Sample]:
        """Samples `ids`, their reads issued together so they overlap."""
        return self.start_many(ids).result()

    def start_many(self, ids, into=None) -> "PendingSamples":
        """Start reading samples `ids`; returns at once (`result()` waits). `into`: for each id,
        None or a float32 array [its generator tokens, >= its modality's width] whose leading
        columns receive its latents, e.g. its slice of a packed batch: the bytes then go from
        the read buffer to the batch in one copy, and the sample's `latents` is that view."""
        into = [None] * len(ids) if into is None else list(into)
        if len(into) != len(ids):
            raise StoreError(f"start_many: {len(ids)} ids but {len(into)} destinations")
        pending = []
        for i, dest in zip((int(i) for i in ids), into):
            if not 0 <= i < len(self):
                raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
            k = int(np.searchsorted(self._starts, i, side="right") - 1)
            shard = self._shards[k]
            t0, t1, l0, l1, modality, domain, n_clean, grid, fps_mhz = (
                int(x) for x in self._shard_index(shard)[i - self._starts[k]])
            mask = (1 << _GRID_BITS) - 1
            grid_thw = (grid >> 2 * _GRID_BITS, (grid >> _GRID_BITS) & mask, grid & mask)
            if dest is not None and modality != TEXT_ONLY:
                width = self.widths[modality]
                if dest.dtype != np.float32 or dest.ndim != 2 or dest.shape[0] != l1 - l0 or dest.shape[1] < width:
                    raise StoreError(f"sample store {self.dir}: sample {i} has {l1 - l0} x {width} float32 latents; "
                                     f"its destination is {dest.shape} {dest.dtype}")
                dest = dest[:, :width]
            text = self._start_read(shard, "text", t0, t1)
            latents = None if modality == TEXT_ONLY else self._start_read(shard, LATENT_ARRAYS[modality], l0, l1,
                                                                           dest)
            pending.append((i, shard, text, latents, dest, modality, grid_thw, domain, n_clean,
                            fps_mhz / 1000 or None))
        return PendingSamples(self, pending)

    def _start_read(self, shard: str, name: str, start: int, stop: int, out: np.ndarray | None = None):
        array = self._array(shard, name)
        row_bytes = math.prod(array.shape[1:]) * array.dtype.numpy_dtype.itemsize
        # Small reads (text, actions, toy clips) go through tensorstore: its C++ path costs less per
        # read than ours, which wins on large clips (fewer copies, parallel direct I/O).
        if self._reader is not None and (stop - start) * row_bytes >= DIRECT_MIN_BYTES:
            try:
                return shard, name, self._reader.read(os.path.join(self.dir, shard, name), start, stop, out)
            except ShardError as e:
                raise StoreError(f"sample store {self.dir}: cannot read {shard}/{name}: {e}") from None
        if name in LATENT_ARRAYS.values():  # bare inner chunks: read them whole and check their crc32c
            inner = array.chunk_layout.read_chunk.shape[0]
            c0, c1 = start // inner, -(-stop // inner)
            whole = array[c0 * inner:min(c1 * inner, array.shape[0])].read()
            crc = self._chunk_checksums(shard, name)[c0:c1]
            return shard, name, _CheckedRows(whole, crc, inner, start - c0 * inner, stop - start, c0,
                                             self.dir / shard / name)
        return shard, name, array[start:stop].read()

    def _chunk_checksums(self, shard: str, name: str) -> np.ndarray:
        key = (shard, name)
        if key not in self._checksums:
            try:
                self._checksums[key] = np.asarray(read_chunk_checksums(self.dir / shard / name), np.uint32)
            except ValueError as e:
                raise StoreError(f"sample store {self.dir}: the crc32c side array of {shard}/{name} is missing or "
                                 f"damaged ({e})") from None
        return self._checksums[key]

    def close(self) -> None:
        """Stop the reader's threads and close its files (a store not closed keeps them until exit)."""
        if self._reader is not None:
            self._reader.close()

    def _finish_read(self, pending) -> np.ndarray:
        shard, name, future = pending
        try:
            return future.result()
        except ValueError as e:
            raise StoreError(f"sample store {self.dir}: cannot read {shard}/{name}: {e}") from None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(manifest: dict, path: pathlib.Path) -> dict[int, int]:
    """The modality widths of a store's manifest, after checking the fields its readers index
    (a damaged manifest fails here, naming the field, not as a KeyError in a reader), and that
    every shard it names is a directory of this store."""
    def bad(what: str):
        return StoreError(f"{path}: {what}; the store is damaged (write it again: `xlaopt data make`)")

    missing = [k for k in ("num_samples", "widths", "shards", "stats") if k not in manifest]
    if missing:
        raise bad(f"missing field {', '.join(map(repr, missing))}")
    names = {v: k for k, v in MODALITY_NAMES.items()}
    widths = manifest["widths"]
    if not isinstance(widths, dict) or any(k not in names or not _count(v) for k, v in widths.items()):
        raise bad(f"widths = {widths!r} must map modalities ({', '.join(n for n in names if names[n] != TEXT_ONLY)})"
                  f" to latent widths")
    shards = manifest["shards"]
    if not isinstance(shards, list) or not all(isinstance(s, dict) and {"name", "num_samples"} <= set(s)
                                               for s in shards):
        raise bad("shards must be a list of {name, num_samples}")
    for shard in shards:
        name = shard["name"]
        if not isinstance(name, str) or not name.startswith("shard-") or "/" in name or ".." in name:
            raise StoreError(f"{path}: shard name {name!r} is not a shard of this directory")
        if not _count(shard["num_samples"]):
            raise bad(f"shard {name}: num_samples = {shard['num_samples']!r} is not a count")
    if not _count(manifest["num_samples"]) or manifest["num_samples"] != sum(s["num_samples"] for s in shards):
        raise bad(f"num_samples = {manifest['num_samples']!r} is not the sum of its shards' counts")
    if not isinstance(manifest["stats"], dict):
        raise bad("stats is not a table")
    return {names[k]: v for k, v in widths.items()}


class _CheckedRows:
    """A tensorstore read of whole bare inner chunks; `result()` checks each chunk's crc32c
    against the side array and returns the rows asked for."""

    def __init__(self, whole, crc: np.ndarray, inner: int, offset: int, rows: int, first_chunk: int,
                 array: pathlib.Path):
        self._whole, self._crc, self._inner = whole, crc, inner
        self._offset, self._rows, self._first, self._array = offset, rows, first_chunk, array

    def result(self) -> np.ndarray:
        data = self._whole.result()
        chunks = np.zeros((len(self._crc) * self._inner, *data.shape[1:]), data.dtype)
        chunks[:len(data)] = data  # rows past the array's end are zeros in the last chunk
        computed = chunk_crc32c(chunks.reshape(len(self._crc), -1).view(np.uint8))
        if (bad := np.flatnonzero(computed != self._crc)).size:
            raise StoreError(f"crc32c mismatch in inner chunk {self._first + int(bad[0])} of {self._array}: its "
                             f"shard file is corrupted")
        return data[self._offset:self._offset + self._rows]


class PendingSamples:
    """Samples whose reads are in flight (`SampleStore.start_many`)."""

    def __init__(self, store: SampleStore, parts: list):
        self._store, self._parts = store, parts

    def result(self) -> list[Sample]:
        """The samples, in the order asked, each checked (its grid against its latents)."""
        samples = []
        for i, shard, text, latents, dest, modality, grid_thw, domain, n_clean, fps in self._parts:
            if latents is not None:
                latents = self._store._finish_read(latents)
                if dest is not None and latents is not dest:  # read by tensorstore into its own array
                    dest[...] = latents
                    latents = dest
            sample = Sample(self._store._finish_read(text), modality, latents, grid_thw, domain, n_clean, fps)
            sample.validate(f"sample store {self._store.dir}: sample {i} ({shard})")
            samples.append(sample)
        return samples

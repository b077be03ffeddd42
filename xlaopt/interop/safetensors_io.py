"""The safetensors format, read and written with numpy alone: an 8-byte little-endian header
length n, n bytes of JSON (tensor name -> {dtype, shape, data_offsets}, plus an optional
`__metadata__` of string -> string), then the tensors' raw little-endian bytes, offsets
relative to the end of the header.

Reading is lazy: a file's header is read and checked whole when it is opened, and a tensor is
a read-only view of a memory map, its bytes read from disk only when touched, so a checkpoint
far larger than host memory can be placed tensor by tensor (or block by block of a tensor).
The checks are the format's own (the `safetensors` library's): every offset inside the data,
the tensors tiling the data exactly (no overlap, no hole, nothing past the end), a known
dtype, shape x itemsize == byte length, no name twice. Any failure is a `SafetensorsError`
naming the file. Nothing read is ever unpickled or executed: JSON and raw numbers only.

A checkpoint directory is one file or shards listed by an index (`{"weight_map": {tensor:
file}}`); the index's file names are untrusted input and confined to the directory.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from xlaopt.errors import UserError

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
DTYPE_NAMES = {v.name: k for k, v in DTYPES.items()}  # by name: either byte order maps
MAX_HEADER_BYTES = 100 << 20  # the format's own limit; a larger "length" is not a safetensors file
METADATA = "__metadata__"


class SafetensorsError(UserError):
    """A file or index that is not a valid safetensors checkpoint; the message names the file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _unique_object(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a name appears twice: {sorted(k for k in set(keys) if keys.count(k) > 1)[:3]}")
    return dict(pairs)


def _parse_header(path: pathlib.Path, f, size: int) -> tuple[dict, int]:
    """(the header's JSON object, where the data starts)."""
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", f.read(8))
    if n < 2 or n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{path}: header length {n} out of range; not a safetensors file")
    if 8 + n > size:
        raise SafetensorsError(f"{path}: header of {n} bytes runs past the file's {size} bytes (truncated?)")
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_unique_object)
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{path}: unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def _tensor(path: pathlib.Path, name: str, meta, base: int) -> TensorInfo:
    if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{path}: tensor {name!r}: expected exactly dtype, shape, data_offsets; got {meta!r}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if dtype not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    ints = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)  # noqa: E731
    if not ints(shape):
        raise SafetensorsError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsError(f"{path}: tensor {name!r}: shape {shape} of {dtype} is {nbytes} bytes, "
                               f"data_offsets span {offsets[1] - offsets[0]}")
    return TensorInfo(path, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _check_tiling(path: pathlib.Path, tensors: dict[str, TensorInfo], base: int, size: int) -> None:
    """The tensors cover the data exactly: no overlap (one byte read as two tensors), no hole
    and no trailing bytes (room for a second payload), nothing past the end (a truncated file)."""
    at = base
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start < at:
            raise SafetensorsError(f"{path}: tensor {name!r} overlaps the tensor before it (bytes "
                                   f"{info.start - base}..{info.end - base} of the data)")
        if info.start > at:
            raise SafetensorsError(f"{path}: {info.start - at} unindexed bytes before tensor {name!r}")
        at = info.end
    if at > size:
        raise SafetensorsError(f"{path}: the tensors need {at - base} bytes of data, the file holds "
                               f"{size - base} (truncated?)")
    if at < size:
        raise SafetensorsError(f"{path}: {size - at} bytes after the last tensor that no tensor indexes")


def read_header(path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensor name -> TensorInfo, metadata) of one file, every check made; no tensor data is read."""
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, base = _parse_header(path, f, size)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e.strerror or e}") from None
    metadata = header.pop(METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: {METADATA} must map strings to strings, got {metadata!r}")
    tensors = {name: _tensor(path, name, meta, base) for name, meta in header.items()}
    _check_tiling(path, tensors, base, size)
    return tensors, metadata


class SafetensorsFile:
    """One safetensors file: its checked header, and its tensors as read-only memory-mapped views."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._map: np.memmap | None = None

    def array(self, name: str) -> np.ndarray:
        return tensor_view(self.tensors[name], self._data())

    def _data(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        return self._map

    def close(self) -> None:
        # Views handed out keep the mapping alive until they are collected; this drops ours.
        self._map = None


def tensor_view(info: TensorInfo, data: np.ndarray) -> np.ndarray:
    """The tensor as a view of the file's bytes: `.view` accepts any byte offset (numpy reads
    unaligned data), so nothing is copied until the caller copies."""
    return data[info.start:info.end].view(info.np_dtype).reshape(info.shape)


def write_safetensors(path, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` (name -> array, C order, little-endian) to `path`; returns the bytes
    written. The header is padded with spaces so the data starts 8-byte aligned, as the
    `safetensors` library writes it."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict = {METADATA: dict(metadata)} if metadata else {}
    offset = 0
    for name, a in items:
        if name in header:
            raise SafetensorsError(f"{path}: tensor {name!r} given twice (or named {METADATA})")
        dtype = DTYPE_NAMES.get(np.dtype(a.dtype).name)
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor {name!r} has dtype {a.dtype}, which safetensors cannot hold")
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, a in items:
            le = np.ascontiguousarray(a, DTYPES[DTYPE_NAMES[np.dtype(a.dtype).name]])
            f.write(le.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


# ---------------------------------------------------------------------------------------
# A checkpoint directory: one file, or shards with an index.
# ---------------------------------------------------------------------------------------

def confined(directory: pathlib.Path, name, where: str) -> pathlib.Path:
    """`directory / name` for a file name read from an index, refused unless it names a file
    inside `directory` by a relative path without `..`. Symlinks in the directory are not
    resolved: they are the directory's owner's (Hugging Face's cache links every file of a
    snapshot to a blob outside it), while the index is data."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise SafetensorsError(f"{where}: file name {name!r} is not a plain relative path")
    rel = pathlib.PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise SafetensorsError(f"{where}: file name {name!r} points outside {directory}; an index may only "
                               f"name files inside its checkpoint directory")
    return directory / rel


def read_index(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name -> its shard's path, from an index file, every file name confined."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_object)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{path}: unreadable index: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SafetensorsError(f"{path}: no weight_map (tensor name -> file name) in the index")
    return {name: confined(path.parent, file, str(path)) for name, file in weight_map.items()}


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: `index_name` (shards) if present, else `weights_name`.
    Every shard's header is read and checked when opened; tensors are read lazily."""

    def __init__(self, directory, weights_name: str, index_name: str):
        self.directory = pathlib.Path(directory)
        index = self.directory / index_name
        if index.is_file():
            where = read_index(index)
        elif (self.directory / weights_name).is_file():
            where = None
        else:
            raise SafetensorsError(f"{self.directory}: no {weights_name} or {index_name}")
        paths = sorted(set(where.values())) if where else [self.directory / weights_name]
        self.files: dict[pathlib.Path, SafetensorsFile] = {}
        for p in paths:
            if not p.is_file():
                raise SafetensorsError(f"{index}: names {p.name}, which is not a file in {self.directory}")
            self.files[p] = SafetensorsFile(p)
        self.tensors: dict[str, TensorInfo] = {}
        for p, f in self.files.items():
            for name, info in f.tensors.items():
                if name in self.tensors:
                    raise SafetensorsError(f"{p}: tensor {name!r} is also in {self.tensors[name].file.name}")
                if where is not None and where.get(name) != p:
                    raise SafetensorsError(f"{p}: holds tensor {name!r}, which {index.name} does not map to it")
                self.tensors[name] = info
        missing = sorted(set(where or ()) - set(self.tensors))
        if missing:
            raise SafetensorsError(f"{index}: maps {len(missing)} tensors to files that do not hold them: "
                                   f"{', '.join(missing[:5])}")

    def array(self, name: str) -> np.ndarray:
        return self.files[self.tensors[name].file].array(name)

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

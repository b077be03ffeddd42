"""zarr3 array specs for tensorstore: one file per outer chunk, crc32c-checked inner chunks.

Both the sample store and checkpoints use this layout, so plain tensorstore or zarr-python
read them without xlaopt, and a flipped bit or a truncated file fails loudly, naming the file.
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
import tensorstore as ts

from xlaopt.io.crc32c import CODECS as _CRC


def array_spec(path: str | os.PathLike, shape, dtype: str, chunk=None, inner=None, create: bool = True,
               inner_checksums: bool = True) -> dict:
    """A zarr3 spec with one file per `chunk` (default: the whole array). With `inner`, each file
    is a shard of checksummed inner chunks read independently; without, a file is the chunk's
    little-endian bytes followed by their crc32c (4 bytes, little-endian).

    `inner_checksums=False`: inner chunks are their bare bytes (the shard index keeps its
    crc32c), so a run of them is one contiguous range of rows that the disk can write straight
    into its destination; the writer then keeps their crc32c in a side array
    (`chunk_checksums_path`), which readers check."""
    shape = [int(d) for d in shape]
    chunk = [int(d) for d in (chunk or shape)]
    codecs = _CRC
    if shape and inner is not None:
        inner_codecs = _CRC if inner_checksums else _CRC[:1]
        codecs = [{"name": "sharding_indexed",
                   "configuration": {"chunk_shape": [int(d) for d in inner], "codecs": inner_codecs,
                                     "index_codecs": _CRC}}]
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)},
            "metadata": {"shape": shape, "data_type": dtype,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                         "codecs": codecs},
            # Write every chunk, zeros included: a missing file must mean damage, not zeros.
            "store_data_equal_to_fill_value": True}
    if create:
        spec.update(create=True, delete_existing=True)
    return spec


def open_spec(path: str | os.PathLike) -> dict:
    """The spec that opens an existing array (its metadata comes from its zarr.json)."""
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, "open": True}


def chunk_checksums_path(path: str | os.PathLike) -> pathlib.Path:
    """Where an array written with `inner_checksums=False` keeps its inner chunks' crc32c: a
    uint32 array beside it (`video` -> `video_crc32c`), one entry per inner chunk in row order,
    each over the chunk's whole encoded bytes (rows past the array's end are zeros)."""
    path = pathlib.Path(path)
    return path.with_name(path.name + "_crc32c")


def read_chunk_checksums(path: str | os.PathLike) -> np.ndarray:
    """The side array of `chunk_checksums_path(path)` (itself crc32c-checked by tensorstore)."""
    return ts.open(open_spec(chunk_checksums_path(path))).result().read().result()

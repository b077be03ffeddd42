"""crc32c, the checksum on every chunk xlaopt writes: the zarr3 codec chain that appends it, and
the hardware checksum of many chunks at once."""
from __future__ import annotations

import google_crc32c
import numpy as np

# zarr3 codecs of a checksummed chunk: its little-endian bytes, then their crc32c (4 bytes, LE).
# `CODECS[:1]` is the bare bytes of a chunk whose crc32c is kept elsewhere.
CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def chunk_crc32c(chunks: np.ndarray) -> np.ndarray:
    """The crc32c of each row of `chunks` (uint8 [chunks, bytes])."""
    return np.fromiter((google_crc32c.value(c) for c in chunks), np.uint32, len(chunks))

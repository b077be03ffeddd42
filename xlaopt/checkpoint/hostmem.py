"""Host buffers and file opening for bulk reads (checkpoints, sample stores).

Fresh host memory costs more to fault in than a disk costs to fill it (measured here: 1-2 GB/s
for 4 KiB pages on this VM). Buffers of 2 MiB and more are therefore aligned to 2 MiB, so the
transparent huge pages numpy requests for large allocations cover them whole (6.6 GB/s here);
every buffer is at least page-aligned, which JAX's CPU client needs to adopt it without a copy
and direct I/O needs to read into it."""
from __future__ import annotations

import errno
import os

import numpy as np

PAGE = 4096
HUGE_PAGE = 2 << 20


def aligned_empty(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    align = HUGE_PAGE if nbytes >= HUGE_PAGE else PAGE
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def host_copy(x) -> np.ndarray:
    """A private, aligned host copy of an array (device or host)."""
    src = np.asarray(x)
    out = aligned_empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out


def open_for_reading(path, direct: bool = True) -> tuple[int, bool]:
    """(fd, is_direct): direct I/O where asked and the filesystem allows it, so the disk writes
    into our aligned buffer without a page-cache copy (less CPU on a small host); plain reads
    otherwise (tmpfs refuses O_DIRECT with EINVAL)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW
    if direct and getattr(os, "O_DIRECT", 0):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False

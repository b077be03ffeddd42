"""The one direct-I/O reader: a file opened with O_DIRECT where the filesystem allows it, read by
positioned reads into page-aligned buffers, and the fallback to plain reads where O_DIRECT is
refused (at open, or on a read).

Direct reads let the disk write into our aligned buffer without a page-cache copy (less CPU on
a small host). Checkpoint restores (`xlaopt.checkpoint.reader`, a whole chunk file per read)
and the sample store's shard reads (`xlaopt.data.shard_reader`, ranges of a shard file, some
straight into a batch) both read through `DirectFile`.
"""
from __future__ import annotations

import errno
import os
import threading

import numpy as np

from xlaopt.io.hostmem import PAGE, aligned_empty

DIRECT_ALIGN = 512  # O_DIRECT: file offset, memory address and length in whole logical blocks
_PLAIN = os.O_RDONLY | os.O_NOFOLLOW


def open_for_reading(path, direct: bool = True) -> tuple[int, bool]:
    """(fd, is_direct): direct I/O where asked and the filesystem allows it, so the disk writes
    into our aligned buffer without a page-cache copy (less CPU on a small host); plain reads
    otherwise (tmpfs refuses O_DIRECT with EINVAL)."""
    if direct and getattr(os, "O_DIRECT", 0):
        try:
            return os.open(path, _PLAIN | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, _PLAIN), False


class ShortRead(Exception):
    """The file ended `missing` bytes before a read's end, at byte `offset` (truncated). Callers
    turn it into their own error naming what the file is."""

    def __init__(self, path, offset: int, missing: int):
        super().__init__(f"{path}: {missing} bytes short at offset {offset} (truncated)")
        self.path, self.offset, self.missing = path, offset, missing


class DirectFile:
    """One file open for positioned reads: O_DIRECT where the filesystem takes it (`direct`
    says whether it did), plus a page-cache descriptor, opened when first needed, for reads
    under `min_direct_bytes` (O_DIRECT would send every re-read of a small range to the disk)
    and for reads into memory the caller aligned but the filesystem refuses. Safe to read from
    several threads at once."""

    def __init__(self, path, direct: bool = True, min_direct_bytes: int = 0):
        self.path, self.min_direct_bytes = path, min_direct_bytes
        self._lock = threading.Lock()
        self._retired: list[int] = []  # descriptors replaced while other threads may use them
        self.fd, self.direct = open_for_reading(path, direct)
        self._cached_fd = None if self.direct else self.fd

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in {self.fd, self._cached_fd, *self._retired} - {None}:
            os.close(fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    @property
    def cached_fd(self) -> int:
        """A descriptor that reads through the page cache (the file's own when not direct)."""
        if self._cached_fd is None:
            with self._lock:
                if self._cached_fd is None:
                    self._cached_fd = os.open(self.path, _PLAIN)
        return self._cached_fd

    def pread(self, offset: int, length: int, buf: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Bytes [offset, offset + length) of the file and the page-aligned buffer they were
        read into: `buf` when large enough, else a new one (direct I/O reads whole aligned
        blocks around the range, so the buffer holds a little more). Raises `ShortRead` when
        the file ends first."""
        fd, direct = self.fd, self.direct
        if direct and length < self.min_direct_bytes:
            fd, direct = self.cached_fd, False
        lo = offset - offset % PAGE if direct else offset
        hi = -(-(offset + length) // PAGE) * PAGE if direct else offset + length
        if buf is None or len(buf) < hi - lo:
            buf = aligned_empty((max(hi - lo, PAGE),), np.uint8)
        done = 0
        while done < hi - lo:
            try:
                n = os.preadv(fd, [memoryview(buf)[done:hi - lo]], lo + done)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                self._plain_reads(fd)
                return self.pread(offset, length, buf)
            if n == 0:
                break
            done += n
        if done < offset + length - lo:
            raise ShortRead(self.path, lo + done, offset + length - lo - done)
        return buf[offset - lo:offset - lo + length], buf

    def pread_into(self, offset: int, dest: np.ndarray) -> None:
        """Bytes [offset, offset + len(dest)) of the file straight into `dest` (uint8): with direct
        I/O when the file has it (the caller aligned offset, address and length to
        `DIRECT_ALIGN`), through the page cache for a read the filesystem refuses so (this read
        only: the refusal may be this memory's, not the file's). Raises `ShortRead` when the
        file ends first."""
        direct = self.direct
        fd, done = (self.fd if direct else self.cached_fd), 0
        while done < len(dest):
            try:
                n = os.preadv(fd, [memoryview(dest)[done:]], offset + done)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                fd, direct = self.cached_fd, False
                continue
            if n == 0:
                raise ShortRead(self.path, offset + done, len(dest) - done)
            done += n

    def _plain_reads(self, fd: int) -> None:
        """The filesystem took O_DIRECT at open but refuses a read into our own aligned buffer:
        switch to plain reads. The old descriptor stays open until the file closes, as other
        threads may be using it."""
        with self._lock:
            if self.fd == fd and self.direct:
                self._retired.append(fd)
                self.fd, self.direct = os.open(self.path, _PLAIN), False

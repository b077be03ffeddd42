"""What the disk itself does: a dd-style durable write and a cold sequential read, and a way
to make the next read cold."""
from __future__ import annotations

import os
import pathlib
import time

_BLOCK = 16 << 20

# Root can empty the whole machine's page cache (/proc/sys/vm/drop_caches), which slows every
# other process on the host until it refills. Only `xlaopt bench` asks for that; any other
# caller (the tests run these benchmarks small) evicts just the benchmark's own files.
_system_drop = False


def allow_system_drop(allowed: bool = True) -> None:
    """Let `drop_page_cache` write /proc/sys/vm/drop_caches when it may (root)."""
    global _system_drop
    _system_drop = allowed


def drop_page_cache(paths: list[pathlib.Path]) -> str:
    """Evict `paths` (files or directories) from the page cache; says how."""
    os.sync()
    if _system_drop:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    # Not asked to, or no root: ask the kernel to drop each (now clean) file's pages.
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED) per file" + (" (no root for drop_caches)" if _system_drop else "")


def write_durable_MBps(path: pathlib.Path, nbytes: int) -> float:
    """`dd bs=16M conv=fdatasync`: write `nbytes`, fdatasync, rate in MB/s."""
    block = os.urandom(_BLOCK)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:min(left, _BLOCK)])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return nbytes / (time.perf_counter() - t0) / 1e6


def read_cold_MBps(path: pathlib.Path) -> float:
    return read_files_cold_MBps([path])


def read_files_cold_MBps(files: list[pathlib.Path]) -> float:
    """Cold (page cache dropped), sequential, 16 MiB unbuffered reads of `files` in turn."""
    drop_page_cache(files)
    t0 = time.perf_counter()
    n = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_BLOCK):
                n += len(chunk)
    return n / (time.perf_counter() - t0) / 1e6


def probe_read_cold_MBps(where: pathlib.Path, nbytes: int) -> float:
    """The cold read rate of a fresh `nbytes` file written durably in `where` (then removed)."""
    probe = where / f".xlaopt-bench-disk-{os.getpid()}.bin"
    try:
        write_durable_MBps(probe, nbytes)
        return read_cold_MBps(probe)
    finally:
        probe.unlink(missing_ok=True)

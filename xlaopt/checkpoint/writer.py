"""Write a snapshot into a step's temporary directory with tensorstore, durably, bringing its
shards to host one at a time and holding at most a bounded number of bytes in flight."""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import pathlib

import numpy as np
import tensorstore as ts

from xlaopt.checkpoint.layout import ARRAYS, CheckpointError, fsync_dir, fsync_file
from xlaopt.checkpoint.tree import LeafSnapshot
from xlaopt.io.zarr3 import array_spec

DEFAULT_INFLIGHT_BYTES = 64 << 20


def ts_context() -> ts.Context:
    # We fsync ourselves, each file once, as soon as its write lands (so the disk starts
    # early); tensorstore's own sync would add a second flush per write.
    return ts.Context({"file_io_sync": False, "file_io_concurrency": {"limit": 64},
                       "data_copy_concurrency": {"limit": 4}})


def chunk_coords(region, chunk) -> list[tuple[int, ...]]:
    """Grid coordinates of the chunks a region ((start, stop) per dim) touches."""
    ranges = [range(start // c, -(-stop // c)) for (start, stop), c in zip(region, chunk)]
    return list(itertools.product(*ranges))


def chunk_path(array_dir: pathlib.Path, coords: tuple[int, ...]) -> pathlib.Path:
    """zarr3's default chunk key: c/i/j/... (just `c` for a rank-0 array)."""
    return array_dir.joinpath("c", *map(str, coords))


def region_of(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def write_leaves(step_tmp: pathlib.Path, leaves: list[LeafSnapshot], context: ts.Context,
                 inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
    """Write every shard in `leaves`, releasing each copy once it is written, and fsync every
    file and directory. Errors name the array and the file.

    A shard on a device comes to host just before its write is queued: an accelerator's host
    memory then holds at most about `inflight_bytes` of the snapshot; on CPU `np.asarray` is a
    view of the copy, so nothing is copied again."""
    arrays_dir = step_tmp / ARRAYS
    pending = collections.deque()  # (future, leaf, files, nbytes)
    in_flight = 0
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ckpt-fsync") as syncer:
        syncs = []

        def land(entry):
            nonlocal in_flight
            future, leaf, paths, nbytes = entry
            try:
                future.result()
            except Exception as e:  # tensorstore raises ValueError with the OS error inside
                raise CheckpointError(f"writing {leaf.name} to {paths[0].parent}: {e}") from None
            in_flight -= nbytes
            syncs.extend(syncer.submit(fsync_file, path) for path in paths)

        for leaf in leaves:
            array_dir = arrays_dir.joinpath(*leaf.name.split("/"))
            spec = array_spec(array_dir, leaf.shape, leaf.dtype, leaf.chunk, create=False)
            try:
                # create-or-open: in a multi-process save every process opens the same array
                store = ts.open(dict(spec, create=True, open=True), context=context).result()
            except Exception as e:
                raise CheckpointError(f"creating {leaf.name} in {array_dir}: {e}") from None
            shards = leaf.take_shards()
            for k, (index, data) in enumerate(shards):
                data = np.asarray(data)  # waits for this shard's device copy, if still running
                files = [chunk_path(array_dir, c) for c in chunk_coords(region_of(index, leaf.shape), leaf.chunk)]
                pending.append((store[index].write(data), leaf, files, data.nbytes))
                shards[k] = (index, None)  # the future keeps the data alive until written
                in_flight += data.nbytes
                while in_flight > inflight_bytes and pending:
                    land(pending.popleft())
        while pending:
            land(pending.popleft())
        for future in syncs:
            future.result()
    for path in sorted(arrays_dir.rglob("zarr.json")):
        fsync_file(path)
    for path in sorted((p for p in arrays_dir.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(path)
    fsync_dir(arrays_dir)
    fsync_dir(step_tmp)


def list_files(step_tmp: pathlib.Path) -> dict[str, int]:
    """Every file of the step's arrays, relative to the step directory, with its size."""
    return {str(p.relative_to(step_tmp)): p.stat().st_size
            for p in sorted((step_tmp / ARRAYS).rglob("*")) if p.is_file()}

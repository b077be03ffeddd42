"""Checkpoints of a training run: asynchronous, atomic saves with retention; restores onto
any mesh and process count.

Every process calls `save` and `restore` together (as with any multi-process JAX call). A save
blocks only while this process copies its shards to host memory; a background thread writes
them, and process 0 commits once every process has made its part durable.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import threading
import time

import jax

from xlaopt.checkpoint import coordination
from xlaopt.checkpoint.layout import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    committed_steps,
    debris,
    fsync_dir,
    open_root,
    read_manifest,
    remove_tree,
    step_dir_name,
    tmp_dir_name,
    write_json_durable,
)
from xlaopt.checkpoint.restore import restore_tree
from xlaopt.checkpoint.tree import snapshot
from xlaopt.checkpoint.writer import DEFAULT_INFLIGHT_BYTES, list_files, ts_context, write_leaves


@dataclasses.dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` steps, plus every step divisible by `keep_every`."""
    keep_last: int = 3
    keep_every: int | None = None

    def __post_init__(self):
        if self.keep_last < 1:
            raise CheckpointError(f"keep_last={self.keep_last}: keep at least the newest checkpoint")
        if self.keep_every is not None and self.keep_every < 1:
            raise CheckpointError(f"keep_every={self.keep_every}: must be a positive step interval")

    def doomed(self, steps: list[int]) -> list[int]:
        kept = set(steps[-self.keep_last:])
        if self.keep_every:
            kept |= {s for s in steps if s % self.keep_every == 0}
        return [s for s in steps if s not in kept]


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    step: int
    bytes: int  # bytes this process writes
    blocking_s: float  # time the caller was blocked (host copy, plus waiting for a previous save)


class CheckpointManager:
    def __init__(self, root, retention: Retention = Retention(), inflight_bytes: int = DEFAULT_INFLIGHT_BYTES):
        self.retention, self.inflight_bytes = retention, inflight_bytes
        self.root = pathlib.Path(root)
        if jax.process_index() == 0:
            open_root(self.root, create=True)
            for path in debris(self.root):  # interrupted saves and deletes from an earlier run
                remove_tree(path)
        self._tag = hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]
        coordination.barrier(f"xlaopt-ckpt-open-{self._tag}")
        open_root(self.root, create=False)
        self._saves = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._context = ts_context()

    # -- reading -------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return committed_steps(self.root)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> dict:
        return read_manifest(self.root / step_dir_name(step))

    def restore(self, target, step: int | None = None, partial: bool = False):
        """(tree, meta, report) for `step` (default: the newest), laid out like `target`."""
        step = self.latest() if step is None else step
        if step is None or step not in self.steps():
            raise CheckpointError(f"{self.root}: no committed checkpoint"
                                  + ("" if step is None else f" for step {step} (have {self.steps()})"))
        step_dir = self.root / step_dir_name(step)
        manifest = read_manifest(step_dir)
        tree, report = restore_tree(step_dir, manifest, target, partial)
        return tree, manifest["meta"], report

    # -- writing -------------------------------------------------------------------------
    def save(self, step: int, tree, meta: dict | None = None) -> SaveInfo:
        """Start saving `tree` as `step`; returns once the host copy is taken. `meta` is
        JSON-able run state saved alongside (data iterator position, config).

        The whole copy is taken before the writer starts: started alongside, the writer
        competes with it for the host's cores and the caller blocks longer (measured here:
        4x the copy time, for a save finished ~10% sooner)."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight: its host copy is the memory we promised to bound
        if step in self.steps():
            raise CheckpointError(f"{self.root}: step {step} is already committed; saves must move forward")
        leaves = list(snapshot(tree))
        blocking_s = time.perf_counter() - t0
        nbytes = sum(leaf.nbytes for leaf in leaves)  # before the writer releases the host copies
        self._saves += 1
        key = f"xlaopt-ckpt/{self._tag}/{self._saves}"
        self._thread = threading.Thread(target=self._write, args=(step, leaves, meta or {}, key),
                                        name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        return SaveInfo(step, nbytes, blocking_s)

    def wait(self) -> None:
        """Block until the save in flight has finished; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self.wait()
        coordination.barrier(f"xlaopt-ckpt-close-{self._tag}-{self._saves}")

    def _write(self, step: int, leaves, meta: dict, key: str) -> None:
        tmp = self.root / tmp_dir_name(step)
        try:
            tmp.mkdir(exist_ok=True)
            write_leaves(tmp, leaves, self._context, self.inflight_bytes)
            coordination.announce(key, "ok")
            if jax.process_index() == 0:
                peers = coordination.gather(key)
                if any(p != "ok" for p in peers):
                    raise CheckpointError(f"step {step}: another process failed its part: {peers}")
                self._commit(step, tmp, leaves, meta)
        except BaseException as e:  # noqa: BLE001 - reported to the caller by wait()
            coordination.announce(key, f"failed: {e}")
            if jax.process_index() == 0:
                remove_tree(tmp)
            last = self.latest()
            self._error = CheckpointError(
                f"save of step {step} to {self.root} failed: {e}. Nothing was committed; "
                + (f"step {last} is intact." if last is not None else "there is no earlier checkpoint."))

    def _commit(self, step: int, tmp: pathlib.Path, leaves, meta: dict) -> None:
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "process_count": jax.process_count(),
                    "leaves": [leaf.describe() for leaf in leaves], "files": list_files(tmp), "meta": meta}
        write_json_durable(tmp / MANIFEST, manifest)
        final = self.root / step_dir_name(step)
        tmp.rename(final)
        fsync_dir(self.root)
        for old in self.retention.doomed(self.steps()):
            remove_tree(self.root / step_dir_name(old))


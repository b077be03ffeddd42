"""The local checkpoint tier: frequent saves to each process's node-local disk (or /dev/shm),
each copied to `peers` other processes, so that losing one node loses nothing.

    LOCAL/process-00001/step_00000040.p00001.xlt   process 1's own shards of step 40
    LOCAL/process-00001/step_00000040.p00000.xlt   process 0's, the copy process 1 keeps for it
    LOCAL/process-00001/.step_00000050.p00001.tmp  a save in progress (debris after a crash)

Each file is one blob (`local_format`): written under a temporary name, fsync'd, renamed. A
process keeps its own shards and, for each of the `peers` processes before it, their shards,
received over the devices' links (`peer.send`). A restore takes the newest step the job holds
whole, over both tiers: every process reports what it holds (damaged files count as absent),
and each rebuilds its arrays from its own copy, or from the copy a peer sends back. Only the
layout it was saved on; a run on another layout, or a step the local tier cannot serve,
restores the persistent tier.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time

import jax
import numpy as np

from xlaopt.checkpoint import coordination, local_format, peer
from xlaopt.checkpoint.layout import CheckpointError, fsync_dir
from xlaopt.io.node_local import check_peers

_FILE = re.compile(r"^step_(\d{8,})\.p(\d{5,})\.xlt$")


def process_dir(root, process: int) -> pathlib.Path:
    return pathlib.Path(root) / f"process-{process:05d}"


def file_name(step: int, owner: int) -> str:
    return f"step_{step:08d}.p{owner:05d}.xlt"


class LocalTier:
    """This process's part of a job's local tier under `root`; every process makes one, together."""

    def __init__(self, root, peers: int, keep: int = 2, fresh: bool = False):
        """`fresh`: a run that does not resume, whose steps an earlier run's files must not outrank."""
        self.me, self.n, self.peers, self.keep = jax.process_index(), jax.process_count(), peers, keep
        check_peers(peers, self.n)
        self.dir = process_dir(root, self.me)
        self.dir.mkdir(parents=True, exist_ok=True)
        for debris in self.dir.glob(".step_*.tmp"):
            debris.unlink(missing_ok=True)
        if fresh:
            for step, owner in self._files():
                (self.dir / file_name(step, owner)).unlink(missing_ok=True)
        self._agreements = 0
        self.sources: list[int] = []  # of the last fetch: per process, how many places on its copy was held

    # -- writing -------------------------------------------------------------------------
    def save(self, step: int, tree, meta: dict) -> float:
        """Save this process's shards of `tree` as `step`, here and with the peers; the seconds it
        blocked. Every process calls it at the same step."""
        t0 = time.perf_counter()
        blob = local_format.pack(step, tree, meta, self.me, self.n)
        self._write(step, self.me, blob)
        for shift in range(1, self.peers + 1):
            self._write(step, (self.me - shift) % self.n, peer.send(blob, shift))
        self._retire()
        return time.perf_counter() - t0

    def _write(self, step: int, owner: int, blob: bytes) -> None:
        final = self.dir / file_name(step, owner)
        tmp = self.dir / f".{final.stem}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(self.dir)

    def _retire(self) -> None:
        steps = sorted({step for step, _ in self._files()})
        for step, owner in self._files():
            if step not in steps[-self.keep:]:
                (self.dir / file_name(step, owner)).unlink(missing_ok=True)

    def _files(self) -> list[tuple[int, int]]:
        return [(int(m.group(1)), int(m.group(2))) for p in self.dir.iterdir() if (m := _FILE.match(p.name))]

    # -- reading -------------------------------------------------------------------------
    def holdings(self) -> dict[int, list[int]]:
        """owner -> the steps of its shards held here whole (checksum verified), newest first;
        a damaged file is reported on one line and left out."""
        held: dict[int, list[int]] = {}
        other_jobs = set()
        for step, owner in sorted(self._files(), reverse=True):
            path = self.dir / file_name(step, owner)
            try:
                header, _ = local_format.unpack(path.read_bytes(), str(path))
                if header["step"] != step or header["process"] != owner:
                    raise CheckpointError(f"{path}: holds step {header['step']} of process {header['process']}, "
                                          f"not what its name says")
            except (CheckpointError, OSError) as e:
                _warn(f"xlaopt train: warning: local tier: {e}; not using it")
                continue
            if header["process_count"] != self.n:  # an elastic restart: the persistent tier serves it
                other_jobs.add(header["process_count"])
                continue
            held.setdefault(owner, []).append(step)
        if other_jobs:
            _warn(f"xlaopt train: the local tier in {self.dir} holds steps of a job of {sorted(other_jobs)} processes, "
                  f"this one has {self.n}: not using them")
        return held

    def agree(self, persistent: int | None) -> int | None:
        """The step the job restores from this tier: the newest every process can rebuild (from its
        own copy or a peer's), if newer than the persistent tier's `persistent` (or as new: the local
        read is the cheaper); else None. Every process calls it together and gets the same answer."""
        self._agreements += 1
        mine = {str(owner): steps for owner, steps in self.holdings().items()}
        shared = coordination.share(f"xlaopt-local/{self._agreements}", json.dumps(mine))
        self._everyone = [{int(k): v for k, v in json.loads(s).items()} for s in shared]
        step = newest_complete(self._everyone, self.n, self.peers)
        return step if step is not None and (persistent is None or step >= persistent) else None

    def fetch(self, step: int) -> tuple[dict, memoryview, str]:
        """(header, payload, where it came from) of this process's shards of an agreed `step`: its
        own file, or the copy a peer holds, sent back. Every process calls it together."""
        self.sources = sources = [source_of(self._everyone, i, step, self.n, self.peers) for i in range(self.n)]
        blob, where = None, None
        if sources[self.me] == 0:
            path = self.dir / file_name(step, self.me)
            blob, where = path.read_bytes(), str(path)
        for shift in sorted({s for s in sources if s}):
            # Each holder `shift` places on sends back the copy it keeps for the process `shift` before it.
            owner = (self.me - shift) % self.n
            mine = b""
            if sources[owner] == shift:
                mine = (self.dir / file_name(step, owner)).read_bytes()
            got = peer.send(mine, -shift)
            if sources[self.me] == shift:
                blob, where = got, f"process {(self.me + shift) % self.n}'s copy of process {self.me}'s step {step}"
        header, payload = local_format.unpack(blob, where)
        return header, payload, where


def _warn(line: str) -> None:
    """One line to stderr in one write: the job's processes share the stream, and print's separate
    write of the newline let two processes' warnings run into one line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def newest_complete(everyone: list[dict[int, list[int]]], n: int, peers: int) -> int | None:
    """The newest step whose shards every process can get: held by itself or one of the `peers`
    processes after it (`everyone[j][i]`: the steps of process i's shards process j holds)."""
    steps = sorted({s for held in everyone for ss in held.values() for s in ss}, reverse=True)
    return next((s for s in steps if all(source_of(everyone, i, s, n, peers) is not None for i in range(n))), None)


def source_of(everyone: list[dict[int, list[int]]], i: int, step: int, n: int, peers: int) -> int | None:
    """How many places on from process i the nearest holder of i's `step` is (0: i itself)."""
    return next((k for k in range(peers + 1) if step in everyone[(i + k) % n].get(i, ())), None)


# -- read-only views of a whole local tier (`xlaopt ckpt verify|diff`) ---------------------
def is_local_tier(root) -> bool:
    root = pathlib.Path(root)
    return root.is_dir() and any(p.is_dir() and p.name.startswith("process-") for p in root.iterdir())


def _all_files(root: pathlib.Path) -> list[tuple[int, int, pathlib.Path]]:
    """(step, owner, path) of every file in every process's directory."""
    return [(int(m.group(1)), int(m.group(2)), p) for d in sorted(root.glob("process-*")) if d.is_dir()
            for p in sorted(d.iterdir()) if (m := _FILE.match(p.name))]


def verify_tier(root, step: int | None = None) -> dict:
    """Every file's checksum and header; a step is whole when each process's shards have a sound
    copy somewhere (`faults` per step: the damaged files, and the processes no sound copy covers).
    `in_progress`: the newest step when a stop cut its save short, every file of it sound but some
    processes' never written; restores pass over it (`newest_complete`), as over a persistent
    tier's uncommitted step, so it is no fault. A damaged file is a fault at any step."""
    root = pathlib.Path(root)
    files = [f for f in _all_files(root) if step is None or f[0] == step]
    if not files:
        raise CheckpointError(f"{root}: no local-tier step" + ("" if step is None else f" {step}"))
    result = {"dir": str(root), "steps": {}}
    sound: dict[int, set] = {}
    counts: dict[int, int] = {}
    for s, owner, path in files:
        faults = result["steps"].setdefault(s, [])
        try:
            header, _ = local_format.unpack(path.read_bytes(), str(path))
            counts[s] = header["process_count"]
            sound.setdefault(s, set()).add(owner)
        except CheckpointError as e:
            faults.append(str(e))
    unwritten = {}
    for s, faults in result["steps"].items():
        missing = sorted(set(range(counts.get(s, 0))) - sound.get(s, set())) if s in counts else ["all"]
        if missing:
            unwritten[s] = not faults and s in counts
            faults.append(f"step {s}: no sound copy of process {', '.join(map(str, missing))}'s shards")
    newest = max(result["steps"])
    if step is None and len(result["steps"]) > 1 and unwritten.get(newest):
        result["in_progress"] = {newest: result["steps"].pop(newest)[0]}
    result["ok"] = not any(result["steps"].values())
    return result


def read_tier(root, step: int | None = None) -> tuple[int, dict[str, np.ndarray], dict]:
    """(step, every leaf as a whole host array by name, the run's meta) of a local tier's step
    (default: the newest whole one), from a sound copy of each process's shards."""
    root = pathlib.Path(root)
    copies: dict[int, dict[int, list[pathlib.Path]]] = {}
    for s, owner, path in _all_files(root):  # the owner's own copy first, then its peers'
        paths = copies.setdefault(s, {}).setdefault(owner, [])
        paths.insert(0, path) if path.parent == process_dir(root, owner) else paths.append(path)
    steps = sorted(copies, reverse=True) if step is None else [step]
    for s in steps:
        try:
            return (s, *_assemble_whole(copies.get(s, {}), f"{root} step {s}"))
        except CheckpointError:
            if step is not None:
                raise
    raise CheckpointError(f"{root}: no whole local-tier step")


def _sound(paths: list[pathlib.Path]) -> tuple[dict, memoryview]:
    """The first of an owner's copies that unpacks whole."""
    for k, path in enumerate(paths):
        try:
            return local_format.unpack(path.read_bytes(), str(path))
        except CheckpointError:
            if k == len(paths) - 1:
                raise


def _assemble_whole(owners: dict[int, list[pathlib.Path]], where: str) -> tuple[dict[str, np.ndarray], dict]:
    arrays: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}
    meta, count = None, None
    for _, paths in sorted(owners.items()):
        header, payload = _sound(paths)
        meta, count = header["meta"], header["process_count"]
        held = local_format.shards(header, payload)
        for leaf in header["leaves"]:
            name = leaf["name"]
            whole = arrays.setdefault(name, np.zeros(leaf["shape"], np.dtype(leaf["dtype"])))
            mask = covered.setdefault(name, np.zeros(leaf["shape"], bool))
            for region, data in held[name].items():
                index = tuple(slice(a, b) for a, b in region)
                whole[index], mask[index] = data, True
    if count is None or sorted(owners) != list(range(count)):
        raise CheckpointError(f"{where}: holds the shards of processes {sorted(owners)}, not all {count}")
    gaps = [name for name, mask in covered.items() if not mask.all()]
    if gaps:
        raise CheckpointError(f"{where}: the processes' shards leave parts of {', '.join(gaps[:5])} uncovered")
    return arrays, meta

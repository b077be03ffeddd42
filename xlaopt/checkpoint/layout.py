"""The on-disk layout of a checkpoint directory, and durable, confined file operations.

    ROOT/xlaopt-checkpoints.json          marks ROOT as ours (format, version)
    ROOT/step_00000040/manifest.json      tree, dtypes, shapes, shardings, step, files, meta
    ROOT/step_00000040/arrays/<leaf>/     one zarr3 array per leaf (crc32c-checked chunks),
                                          one file per saved shard: c/<i>/<j>/...
    ROOT/.step_00000050.tmp/              a save in progress (invisible until renamed)
    ROOT/.step_00000010.deleting/         retention removing an old step

A step is committed when its directory has its final name: the manifest is written last,
everything is fsync'd, then the temporary directory is renamed and ROOT fsync'd. Anything
starting with a dot is debris from an interrupted save or delete, removed at the next start.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

import numpy as np

from xlaopt.errors import UserError

FORMAT = "xlaopt-checkpoint"
VERSION = 1
ROOT_MARKER = "xlaopt-checkpoints.json"
MANIFEST = "manifest.json"
ARRAYS = "arrays"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")


class CheckpointError(UserError):
    """A checkpoint cannot be written or read; the message names the file and the fix."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def tmp_dir_name(step: int) -> str:
    return f".{step_dir_name(step)}.tmp"


def open_root(root: str | os.PathLike, create: bool) -> pathlib.Path:
    """ROOT as a checkpoint directory; refuses a directory that holds something else."""
    root = pathlib.Path(root)
    if not root.exists():
        if not create:
            raise CheckpointError(f"{root}: no such checkpoint directory")
        root.mkdir(parents=True)
    if not root.is_dir():
        raise CheckpointError(f"{root} is a file, not a checkpoint directory")
    marker = root / ROOT_MARKER
    if marker.exists():
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{marker}: unreadable ({e})") from None
        if not isinstance(info, dict):
            raise CheckpointError(f"{marker}: not a checkpoint root marker (a JSON object with format and version)")
        if info.get("format") != FORMAT or info.get("version") != VERSION:
            raise CheckpointError(f"{marker}: format {info.get('format')} v{info.get('version')}, "
                                  f"this xlaopt reads {FORMAT} v{VERSION}")
        return root
    others = sorted(p.name for p in root.iterdir())
    if others:
        raise CheckpointError(f"{root} is not an xlaopt checkpoint directory (it holds {', '.join(others[:5])}"
                              f"{', ...' if len(others) > 5 else ''}); pick an empty or new directory")
    if not create:
        raise CheckpointError(f"{root}: empty, no checkpoint has been written there")
    write_json_durable(marker, {"format": FORMAT, "version": VERSION})
    return root


def committed_steps(root: pathlib.Path) -> list[int]:
    steps = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def debris(root: pathlib.Path) -> list[pathlib.Path]:
    """Leftovers of interrupted saves and deletes."""
    return sorted(p for p in root.iterdir() if p.name.startswith(".step_"))


def remove_tree(path: pathlib.Path) -> None:
    """Delete a step directory so that a crash midway never leaves a damaged committed step:
    rename it to debris first (one atomic, durable step), then delete."""
    if not path.name.startswith("."):
        doomed = path.with_name(f".{path.name}.deleting")
        os.rename(path, doomed)
        fsync_dir(path.parent)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def fsync_file(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: pathlib.Path, obj) -> None:
    """Write JSON under a temporary name, fsync, rename into place, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(path.parent)


def confined(base: pathlib.Path, relative: str, resolve: bool = True) -> pathlib.Path:
    """`base/relative`, refusing anything that could point outside `base` (metadata is input):
    only plain names, and (with `resolve`) no symlink leading out."""
    parts = relative.split("/")
    if not relative or any(p in (".", "..") or not _SAFE_PART.match(p) for p in parts):
        raise CheckpointError(f"{base}: path {relative!r} in the manifest is not a plain relative path; "
                              f"the checkpoint is damaged or was not written by xlaopt")
    path = base.joinpath(*parts)
    if resolve and not path.resolve().is_relative_to(base.resolve()):
        raise CheckpointError(f"{base}: {relative!r} resolves outside the checkpoint (a symlink?); refusing it")
    return path


def safe_part(part: str, where: str) -> str:
    if not _SAFE_PART.match(part) or part in (".", ".."):
        raise CheckpointError(f"{where}: tree key {part!r} cannot name a file; use keys of letters, digits, '_.-'")
    return part


def read_manifest(step_dir: pathlib.Path) -> dict:
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir}: no {MANIFEST}; not a committed checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: not a manifest (a JSON object); the checkpoint is damaged")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')} v{manifest.get('version')}, "
                              f"this xlaopt reads {FORMAT} v{VERSION}")
    for key in ("step", "leaves", "files", "meta"):
        if key not in manifest:
            raise CheckpointError(f"{path}: missing field {key!r}; the checkpoint is damaged")
    _check_manifest(step_dir, path, manifest)
    return manifest


def _check_manifest(step_dir: pathlib.Path, path: pathlib.Path, manifest: dict) -> None:
    """The manifest's fields have the types its readers index them by, and every path it names
    stays inside the step: it is input, and a damaged one must fail here, by name, not as a
    KeyError in whichever reader touches the field first."""
    def bad(what: str):
        return CheckpointError(f"{path}: {what}; the checkpoint is damaged or was not written by xlaopt")

    def dims(value) -> bool:
        return isinstance(value, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in value)

    step = manifest["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad(f"step = {step!r} is not a step number")
    if not isinstance(manifest["meta"], dict):
        raise bad("meta is not a table")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in files.values()):
        raise bad("files is not a table of file sizes")
    for relative in files:
        confined(step_dir, relative, resolve=False)
    leaves = manifest["leaves"]
    if not isinstance(leaves, list):
        raise bad("leaves is not a list")
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, dict):
            raise bad(f"leaves[{i}] is not a table")
        missing = [k for k in ("name", "shape", "dtype", "chunk", "sharding") if k not in leaf]
        if missing:
            raise bad(f"leaves[{i}] lacks {', '.join(missing)}")
        if not isinstance(leaf["name"], str) or not isinstance(leaf["dtype"], str):
            raise bad(f"leaves[{i}]: name and dtype must be strings")
        sharding = leaf["sharding"]
        if sharding is not None and not (isinstance(sharding, dict) and {"mesh", "spec"} <= set(sharding)):
            raise bad(f"leaf {leaf['name']}: sharding {sharding!r} is neither null nor {{mesh, spec}}")
        confined(step_dir, f"{ARRAYS}/{leaf['name']}", resolve=False)
        shape, chunk = leaf["shape"], leaf["chunk"]
        if not (dims(shape) and dims(chunk) and len(chunk) == len(shape)
                and all(c >= 1 or n == 0 for c, n in zip(chunk, shape))):
            raise bad(f"leaf {leaf['name']}: shape {shape!r} and chunk {chunk!r} must be lists of sizes, one per "
                      f"dimension")
        if not array_dtype(leaf["dtype"]):
            raise bad(f"leaf {leaf['name']}: dtype {leaf['dtype']!r} is not an array dtype")


def array_dtype(name: str) -> bool:
    import ml_dtypes  # registers bfloat16 and the float8s with numpy

    try:
        dtype = np.dtype(name)
    except TypeError:
        return False
    return dtype.kind in "biufc" or getattr(ml_dtypes, dtype.name, None) is dtype.type

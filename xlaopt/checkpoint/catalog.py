"""Read-only views of checkpoint directories for `xlaopt ckpt ls|verify|inspect|diff`."""
from __future__ import annotations

import pathlib

from xlaopt.checkpoint import local
from xlaopt.checkpoint.layout import CheckpointError, committed_steps, debris, open_root, read_manifest, step_dir_name
from xlaopt.checkpoint.restore import check_files, read_all


def _step_dir(root: pathlib.Path, step: int | None) -> pathlib.Path:
    steps = committed_steps(root)
    if not steps:
        raise CheckpointError(f"{root}: no committed checkpoint")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise CheckpointError(f"{root}: no committed step {step}; have {steps}")
    return root / step_dir_name(step)


def listing(root) -> dict:
    root = open_root(root, create=False)
    rows = []
    for step in committed_steps(root):
        manifest = read_manifest(root / step_dir_name(step))
        rows.append({"step": step, "bytes": sum(manifest["files"].values()), "leaves": len(manifest["leaves"]),
                     "files": len(manifest["files"]), "process_count": manifest.get("process_count", 1)})
    return {"dir": str(root), "steps": rows, "debris": [p.name for p in debris(root)]}


def verify(root, step: int | None = None) -> dict:
    """Check every committed step (or one): files present with their sizes, every chunk's
    checksum (by reading it all). `faults` empty means sound. A local tier (`--local-ckpt`'s
    directory): every file's checksum, and each step whole over the processes' copies."""
    if local.is_local_tier(root):
        return local.verify_tier(root, step)
    root = open_root(root, create=False)
    steps = committed_steps(root) if step is None else [step]
    if not steps:
        raise CheckpointError(f"{root}: no committed checkpoint to verify")
    result = {"dir": str(root), "steps": {}}
    for s in steps:
        step_dir = _step_dir(root, s)
        try:
            manifest = read_manifest(step_dir)
            faults = check_files(step_dir, manifest)
            if not faults:
                read_all(step_dir, manifest)
        except CheckpointError as e:
            faults = [str(e)]
        result["steps"][s] = faults
    result["ok"] = not any(result["steps"].values())
    return result


def describe(root, step: int | None = None) -> dict:
    root = open_root(root, create=False)
    return read_manifest(_step_dir(root, step))


def diff(root_a, root_b, step: int | None = None) -> dict:
    """Whether two checkpoints hold the same state: every leaf bit for bit (its bytes, so a NaN
    equals itself and -0.0 differs from 0.0), the same tree, and the same data position. `step`
    in both (default: each one's newest). Reading verifies every chunk's checksum. Either may be a
    local tier, whose step is read whole from its processes' copies."""
    steps, leaves, metas = [], [], []
    for root in (root_a, root_b):
        if local.is_local_tier(root):  # a local tier's step, whole from the processes' copies
            found, arrays, meta = local.read_tier(root, step)
            steps.append(found)
            leaves.append(arrays)
            metas.append(meta)
            continue
        step_dir = _step_dir(open_root(root, create=False), step)
        manifest = read_manifest(step_dir)
        steps.append(manifest["step"])
        leaves.append(read_all(step_dir, manifest))
        metas.append(manifest["meta"])
    a, b = leaves
    differing = [name for name in sorted(a.keys() & b.keys())
                 if a[name].dtype != b[name].dtype or a[name].shape != b[name].shape
                 or a[name].tobytes() != b[name].tobytes()]
    data_equal = metas[0].get("data") == metas[1].get("data")
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    return {"a": str(root_a), "b": str(root_b), "steps": steps, "leaves": len(a.keys() | b.keys()),
            "differing": differing, "only_in_a": only_a, "only_in_b": only_b, "data_state_equal": data_equal,
            "identical": not (differing or only_a or only_b) and data_equal}

"""Restore a committed step onto any mesh: each process reads only the slices its devices
hold, straight from the files, checksums verified chunk by chunk."""
from __future__ import annotations

import os
import pathlib
from stat import S_ISREG

import jax
import numpy as np
import tensorstore as ts

from xlaopt.checkpoint.layout import ARRAYS, CheckpointError, confined
from xlaopt.checkpoint.reader import StepReader
from xlaopt.checkpoint.tree import named_leaves
from xlaopt.checkpoint.writer import region_of, ts_context
from xlaopt.io.zarr3 import open_spec


def check_files(step_dir: pathlib.Path, manifest: dict, names=None) -> list[str]:
    """Faults among the files the manifest lists (for leaves `names`, default all): missing or
    of the wrong size. A missing chunk file would otherwise read back as zeros."""
    faults = []
    prefixes = None if names is None else tuple(f"{ARRAYS}/{n}/" for n in names)
    for relative, size in manifest["files"].items():
        # Names only here (resolving each path costs a stat per component); the array
        # directories the reader opens are resolved, and it opens no symlinked chunk file.
        path = confined(step_dir, relative, resolve=False)
        if prefixes is not None and not relative.startswith(prefixes):
            continue
        try:
            stat = os.lstat(path)
        except FileNotFoundError:
            faults.append(f"{path}: missing")
            continue
        if not S_ISREG(stat.st_mode):
            faults.append(f"{path}: not a regular file (a symlink?)")
        elif stat.st_size != size:
            faults.append(f"{path}: {stat.st_size} bytes, the manifest says {size} (truncated or overwritten)")
    return faults


def tree_differences(manifest: dict, names: list[str], leaves: list) -> tuple[list[str], list[str], list[str]]:
    """(missing from the checkpoint, not in the target, shape or dtype mismatches)."""
    saved = {leaf["name"]: leaf for leaf in manifest["leaves"]}
    missing = [n for n in names if n not in saved]
    unexpected = [n for n in saved if n not in set(names)]
    mismatched = []
    for name, leaf in zip(names, leaves):
        if name in saved:
            s = saved[name]
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype).name
            if tuple(s["shape"]) != shape or s["dtype"] != dtype:
                mismatched.append(f"{name}: saved {s['dtype']}{s['shape']}, target {dtype}{list(shape)}")
    return missing, unexpected, mismatched


def _ts_message(e: Exception) -> str:
    """Tensorstore's message without the JSON spec it appends (a few hundred characters of
    context settings, the path again): the file and the fault come first."""
    return str(e).split(" [tensorstore_spec=")[0]


def _open(step_dir: pathlib.Path, name: str, context):
    path = confined(step_dir, f"{ARRAYS}/{name}")
    try:
        return ts.open(open_spec(path), context=context).result()
    except Exception as e:
        raise CheckpointError(f"{name}: cannot open {path}: {_ts_message(e)}") from None


def _result(future, name: str):
    try:
        return future.result()
    except Exception as e:  # tensorstore's message names the file and the digest mismatch
        raise CheckpointError(f"{name}: {_ts_message(e)}") from None


def restore_tree(step_dir: pathlib.Path, manifest: dict, target, partial: bool = False):
    """Leaves of `target` (arrays or ShapeDtypeStructs with shardings) read from the step.

    Returns (tree, report). A tree that differs from the checkpoint is an error listing the
    differences, unless `partial`: then leaves the checkpoint lacks keep the target's value
    (which must be an array) and leaves the target lacks are ignored; both are reported.
    """
    names, leaves, treedef = named_leaves(target)
    missing, unexpected, mismatched = tree_differences(manifest, names, leaves)
    if mismatched or ((missing or unexpected) and not partial):
        lines = ([f"missing from the checkpoint: {n}" for n in missing] + [f"not in the target: {n}" for n in unexpected]
                 + [f"mismatch: {m}" for m in mismatched])
        hint = "" if mismatched else "; pass partial=True to restore the common leaves only"
        raise CheckpointError(f"{step_dir}: the checkpoint's tree differs from the target ({len(lines)}): "
                              + "; ".join(lines[:12]) + ("; ..." if len(lines) > 12 else "") + hint)
    for name, leaf in zip(names, leaves):
        if name in missing and not isinstance(leaf, jax.Array):
            raise CheckpointError(f"{name}: not in the checkpoint and the target has no value for it")
    wanted = [n for n in names if n not in missing]
    faults = check_files(step_dir, manifest, wanted)
    if faults:
        raise CheckpointError(f"{step_dir}: {len(faults)} damaged file(s): " + "; ".join(faults[:5]))

    reader = StepReader(step_dir, manifest)
    # Queue every chunk read first, in tree order, so the disk stays busy while arrays are built.
    plans = []
    for name, leaf in zip(names, leaves):
        if name in missing:
            plans.append(None)
            continue
        shape, sharding = tuple(leaf.shape), getattr(leaf, "sharding", None)
        if sharding is None:  # to host, whole
            devices = [(None, tuple((0, d) for d in shape))]
        else:
            if jax.dtypes.canonicalize_dtype(leaf.dtype) != np.dtype(leaf.dtype):
                raise CheckpointError(f"{name}: {np.dtype(leaf.dtype).name} cannot live on a device without "
                                      f"jax_enable_x64; restore it to host (no sharding) or enable x64")
            devices = [(d, region_of(index, shape))
                       for d, index in sharding.addressable_devices_indices_map(shape).items()]
        for _, region in devices:
            reader.request(name, region)
        plans.append((sharding, devices))
    out = []
    try:
        for name, leaf, plan in zip(names, leaves, plans):
            if plan is None:
                out.append(leaf)
                continue
            sharding, devices = plan
            regions = {region: reader.region(name, region) for region in dict.fromkeys(r for _, r in devices)}
            if sharding is None:
                out.append(regions[devices[0][1]])
            else:
                shards = [jax.device_put(regions[region], device) for device, region in devices]
                out.append(jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, shards))
            reader.release(name)
    finally:
        reader.close()
    report = {"step": manifest["step"], "restored": len(wanted), "kept_from_target": missing, "ignored": unexpected}
    return jax.tree_util.tree_unflatten(treedef, out), report


def read_all(step_dir: pathlib.Path, manifest: dict) -> dict[str, np.ndarray]:
    """Every leaf as a host array by name; reading verifies every chunk's checksum."""
    context = ts_context()
    futures = {leaf["name"]: _open(step_dir, leaf["name"], context).read() for leaf in manifest["leaves"]}
    return {name: _result(f, name) for name, f in futures.items()}

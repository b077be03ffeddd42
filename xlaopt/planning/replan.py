"""From one layout to another: what the train state's resharding moves.

A run checkpointed on the old layout resumes on the new one by reading its new shards
(`xlaopt train --layout NEW --resume`: the checkpoint is stored by array, not by device).
Device i of the new cluster is taken to be device i of the old one where both have it (a
shrunk cluster keeps its first devices): what it already holds of its new shards stays, the
rest is read. Counted per device over the parameters and AdamW's two moments (fp32 each:
12 bytes per parameter), from each array's PartitionSpec under both rule tables and meshes.
"""
from __future__ import annotations

import math

import numpy as np

from xlaopt.layout import Layout
from xlaopt.mesh import MESH_AXES
from xlaopt.sharding import entry_axes, logical_to_spec

STATE_BYTES_PER_PARAM = 12  # fp32 parameter, Adam m and v


def _coords(layout: Layout) -> dict[str, np.ndarray]:
    """Each mesh axis's coordinate of every device (by device index, node-major)."""
    mesh = layout.mesh
    logical = np.array(np.unravel_index(np.arange(mesh.num_devices), mesh.sizes))  # [axes, positions]
    by_device = np.empty_like(logical)
    by_device[:, list(mesh.placement())] = logical
    return {a: by_device[i] for i, a in enumerate(MESH_AXES)}


def _boxes(spec, shape, layout: Layout, coords) -> tuple[np.ndarray, np.ndarray]:
    """[devices, dims] start and stop of each device's shard."""
    n = layout.mesh.num_devices
    starts, stops = np.zeros((n, len(shape)), np.int64), np.tile(np.array(shape, np.int64), (n, 1))
    for dim, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = entry_axes(entry)
        if not axes:
            continue
        block = np.zeros(n, np.int64)
        for a in axes:  # major to minor
            block = block * layout.mesh.size(a) + coords[a]
        size = shape[dim] // math.prod(layout.mesh.size(a) for a in axes)
        starts[:, dim], stops[:, dim] = block * size, (block + 1) * size
    return starts, stops


def resharding(old: Layout, new: Layout, config) -> dict:
    import jax

    from xlaopt.program import TrainProgram
    from xlaopt.step import abstract_params_with_axes

    params, logical = abstract_params_with_axes(TrainProgram(config))
    leaves, treedef = jax.tree.flatten(params)
    axes = treedef.flatten_up_to(logical)
    n_old, n_new = old.mesh.num_devices, new.mesh.num_devices
    c_old, c_new = _coords(old), _coords(new)
    held_new = np.zeros(n_new)
    moved = np.zeros(n_new)
    held_old = np.zeros(n_old)
    for leaf, ax in zip(leaves, axes):
        shape = tuple(leaf.shape)
        s_old = logical_to_spec(tuple(ax), shape, old.rules, old.mesh, "param")
        s_new = logical_to_spec(tuple(ax), shape, new.rules, new.mesh, "param")
        a0, a1 = _boxes(s_old, shape, old, c_old)
        b0, b1 = _boxes(s_new, shape, new, c_new)
        new_volume = np.prod(b1 - b0, axis=1)
        held_old += np.prod(a1 - a0, axis=1)
        held_new += new_volume
        both = min(n_old, n_new)
        overlap = np.zeros(n_new)
        lo, hi = np.maximum(a0[:both], b0[:both]), np.minimum(a1[:both], b1[:both])
        overlap[:both] = np.prod(np.clip(hi - lo, 0, None), axis=1)
        moved += new_volume - overlap
    b = STATE_BYTES_PER_PARAM
    return {"from": {"mesh": str(old.mesh), "devices": n_old, "topology": old.topology},
            "to": {"mesh": str(new.mesh), "devices": n_new, "topology": new.topology},
            "state_bytes_per_device_old_max": float(held_old.max() * b),
            "state_bytes_per_device_new_max": float(held_new.max() * b),
            "bytes_moved_per_device_max": float(moved.max() * b),
            "bytes_moved_per_device_mean": float(moved.mean() * b),
            "bytes_moved_total": float(moved.sum() * b)}


def format_resharding(r: dict) -> str:
    gib = lambda x: f"{x / 2**30:,.2f} GiB"
    return (f"resharding {r['from']['mesh']} ({r['from']['devices']} devices) -> {r['to']['mesh']} "
            f"({r['to']['devices']} devices): state per device {gib(r['state_bytes_per_device_old_max'])} -> "
            f"{gib(r['state_bytes_per_device_new_max'])}; moved per device {gib(r['bytes_moved_per_device_max'])} "
            f"at most, {gib(r['bytes_moved_per_device_mean'])} on average, {gib(r['bytes_moved_total'])} in all")

"""Bytes sent to a peer process over the devices' own links, for the local tier's peer copies.

Every process calls `send` together (like any multi-process JAX call): its bytes go to the
process `shift` places on, and it gets those of the process `shift` places back. They travel as
one collective permute (`jax.lax.ppermute` in a shard_map over a mesh of one device a process):
gloo between CPU processes, NCCL between GPUs, so a copy reaches another node the way gradients
do, and nothing of ours listens on a socket. The blobs are padded to the longest (the lengths'
maximum found by a collective first); each carries its own length.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_LENGTH = 8  # bytes of the length prefix


@functools.lru_cache(maxsize=None)
def _process_mesh(devices: tuple) -> Mesh:
    first = {}
    for device in sorted(devices, key=lambda d: d.id):
        first.setdefault(device.process_index, device)
    return Mesh(np.array([first[p] for p in sorted(first)]), ("process",))


@functools.lru_cache(maxsize=None)
def _permute(mesh: Mesh, shift: int):
    n = mesh.devices.size
    pairs = [(p, (p + shift) % n) for p in range(n)]
    return jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "process", pairs), mesh=mesh,
                                 in_specs=P("process"), out_specs=P("process")))


@functools.lru_cache(maxsize=None)
def _max(mesh: Mesh):
    return jax.jit(jax.shard_map(lambda x: jax.lax.pmax(x, "process"), mesh=mesh, in_specs=P("process"),
                                 out_specs=P()))


def _longest(mesh: Mesh, length: int) -> int:
    """The longest blob of all processes'. A collective, not the coordination service's key-value
    store: a peer killed meanwhile fails it at once (gloo sees the connection close), where a
    blocking read of the store would wait out its timeout."""
    device = mesh.devices.flat[jax.process_index()]
    x = jax.make_array_from_single_device_arrays((mesh.devices.size,), NamedSharding(mesh, P("process")),
                                                 [jax.device_put(np.array([length], np.int32), device)])
    return int(np.asarray(_max(mesh)(x).addressable_shards[0].data)[0])


def send(blob: bytes, shift: int) -> bytes:
    """`blob` to process (me + shift) mod N; returns the one process (me - shift) mod N sent."""
    n = jax.process_count()
    mesh = _process_mesh(tuple(jax.devices()))
    width = _LENGTH + int(_longest(mesh, len(blob)))
    mine = np.zeros((1, width), np.uint8)
    mine[0, :_LENGTH] = np.frombuffer(len(blob).to_bytes(_LENGTH, "little"), np.uint8)
    mine[0, _LENGTH:_LENGTH + len(blob)] = np.frombuffer(blob, np.uint8)
    device = mesh.devices.flat[jax.process_index()]
    sharding = NamedSharding(mesh, P("process"))
    x = jax.make_array_from_single_device_arrays((n, width), sharding, [jax.device_put(mine, device)])
    got = np.asarray(_permute(mesh, shift % n)(x).addressable_shards[0].data)[0]
    size = int.from_bytes(got[:_LENGTH].tobytes(), "little")
    return got[_LENGTH:_LENGTH + size].tobytes()

"""Pytrees as named leaves, and the host snapshot of the shards this process saves."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import numpy as np

from xlaopt.checkpoint.layout import CheckpointError, safe_part
from xlaopt.io.hostmem import host_copy

# A chunk (one file) is the unit of checksum and of partial reads: small enough that restoring
# onto another sharding reads little it discards, large enough that reads stay sequential.
CHUNK_BYTES = 8 << 20


def _key_part(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise CheckpointError(f"tree key {k!r}: unsupported key type {type(k).__name__}")


def named_leaves(tree) -> tuple[list[str], list, jax.tree_util.PyTreeDef]:
    """Leaves named by their tree path, e.g. 'params/layers/reasoner/q/kernel'."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = []
    for path, _ in flat:
        name = "/".join(_key_part(k) for k in path) or "root"
        for part in name.split("/"):
            safe_part(part, name)
        names.append(name)
    return names, [leaf for _, leaf in flat], treedef


def chunk_shape(shard: tuple[int, ...], itemsize: int, target_bytes: int = CHUNK_BYTES) -> tuple[int, ...]:
    """Split `shard` by prime factors of its largest dims until a chunk is at most `target_bytes`;
    a shard is a whole number of chunks, so each file belongs to exactly one writer."""
    chunk = list(shard)
    while int(np.prod(chunk, dtype=np.int64)) * itemsize > target_bytes:
        splittable = [d for d in range(len(chunk)) if chunk[d] > 1]
        if not splittable:
            break
        d = max(splittable, key=lambda i: chunk[i])
        chunk[d] //= _smallest_factor(chunk[d])
    return tuple(chunk)


def _smallest_factor(n: int) -> int:
    f = 2
    while f * f <= n:
        if n % f == 0:
            return f
        f += 1
    return n


@dataclasses.dataclass
class LeafSnapshot:
    """One leaf: its global description, and the host copies of the shards this process writes."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: tuple[int, ...]  # the saved shard shape
    chunk: tuple[int, ...]  # one file per chunk; a shard is a whole number of chunks
    sharding: dict | None  # {"mesh": {axis: size}, "spec": [...]} for a NamedSharding
    shards: list  # [(index: tuple[slice, ...], host copy: np.ndarray)]

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for _, data in self.shards)

    def describe(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "shard": list(self.shard),
                "chunk": list(self.chunk), "sharding": self.sharding}


def _sharding_json(sharding) -> dict | None:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return {"mesh": dict(sharding.mesh.shape), "spec": spec}
    return None


def snapshot(tree) -> Iterator[LeafSnapshot]:
    """Copy to host, leaf by leaf, the shards this process owns (one replica of each). A
    generator, so a writer can start on the first leaves while later ones are copied."""
    names, leaves, _ = named_leaves(tree)
    first_process = jax.process_index() == 0
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                raise CheckpointError(f"{name}: a typed PRNG key; save jax.random.key_data(key) instead")
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
            shard = tuple(leaf.sharding.shard_shape(leaf.shape))
            shards = [(tuple(s.index), host_copy(s.data)) for s in leaf.addressable_shards if s.replica_id == 0]
            sharding = _sharding_json(leaf.sharding)
        else:
            data = host_copy(leaf)
            shape, dtype, shard, sharding = data.shape, data.dtype, data.shape, None
            shards = [(tuple(slice(None) for _ in shape), data)] if first_process else []
        yield LeafSnapshot(name, shape, dtype.name, shard, chunk_shape(shard, dtype.itemsize), sharding, shards)

"""One process's share of a local-tier step, as one self-checking blob (a file, or bytes sent to a peer).

    b"XLTLOCAL" | version u32 | header length u64 | header (JSON) | payload (raw array bytes)

The header names the step, whose shards these are (`process` of `process_count`), the run's
meta (data position, config), the payload's length and CRC-32, and per leaf its shape, dtype,
sharding and the shards held: `[[start, stop], ...]` per dimension and where its bytes lie. A
process keeps the shards its devices hold, each distinct one once (a replicated leaf once a
process, not once a device), so it can rebuild exactly its own arrays from this blob alone, and
only on the same layout. Nothing is unpickled: JSON and raw little-endian bytes.
"""
from __future__ import annotations

import json
import struct
import zlib

import jax
import numpy as np

from xlaopt.checkpoint.layout import CheckpointError, array_dtype
from xlaopt.checkpoint.tree import named_leaves, sharding_json
from xlaopt.checkpoint.writer import region_of

MAGIC = b"XLTLOCAL"
VERSION = 1
_PREFIX = struct.Struct("<8sIQ")


def pack(step: int, tree, meta: dict, process: int, process_count: int) -> bytes:
    """The blob of this process's shards of `tree` (device arrays, or host values)."""
    names, leaves, _ = named_leaves(tree)
    described, pieces = [], []
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, jax.Array):
            held = {}
            for shard in leaf.addressable_shards:
                held.setdefault(region_of(shard.index, leaf.shape), shard.data)
            regions, datas = list(held), jax.device_get(list(held.values()))
            sharding = sharding_json(leaf.sharding)
        else:
            data = np.asarray(leaf)
            regions, datas, sharding = [tuple((0, d) for d in data.shape)], [data], None
        described.append({"name": name, "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name,
                          "sharding": sharding, "shards": [[list(r) for r in region] for region in regions]})
        pieces += [np.ascontiguousarray(d).tobytes() for d in datas]
    payload = b"".join(pieces)
    header = json.dumps({"step": step, "process": process, "process_count": process_count, "meta": meta,
                         "payload_bytes": len(payload), "crc32": zlib.crc32(payload), "leaves": described}).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload


def unpack(blob: bytes, where: str) -> tuple[dict, memoryview]:
    """(header, payload) of a blob, its checksum and structure checked; a CheckpointError naming
    `where` for anything damaged, cut short or foreign."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise CheckpointError(f"{where}: {len(view)} bytes, shorter than a local-tier header (cut short)")
    magic, version, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CheckpointError(f"{where}: not a local-tier file (it starts {bytes(magic)!r})")
    if version != VERSION:
        raise CheckpointError(f"{where}: local-tier format v{version}, this xlaopt reads v{VERSION}")
    end = _PREFIX.size + length
    try:
        header = json.loads(bytes(view[_PREFIX.size:end]))
    except ValueError as e:
        raise CheckpointError(f"{where}: unreadable header ({e}); the file is damaged") from None
    payload = view[end:]
    _check_header(header, len(payload), where)
    if zlib.crc32(payload) != header["crc32"]:
        raise CheckpointError(f"{where}: checksum mismatch; the file is damaged")
    return header, payload


def _check_header(header, payload_bytes: int, where: str) -> None:
    """The header's fields have the types and bounds the reader relies on (it is input)."""
    def bad(what: str):
        return CheckpointError(f"{where}: {what}; the file is damaged or was not written by xlaopt")

    if not isinstance(header, dict) or not {"step", "process", "process_count", "meta", "payload_bytes", "crc32",
                                            "leaves"} <= set(header):
        raise bad("the header lacks fields")
    if header["payload_bytes"] != payload_bytes:
        raise bad(f"{payload_bytes} payload bytes, the header says {header['payload_bytes']} (cut short?)")
    offset = 0
    for leaf in header["leaves"] if isinstance(header["leaves"], list) else [None]:
        if not (isinstance(leaf, dict) and isinstance(leaf.get("name"), str) and isinstance(leaf.get("shape"), list)
                and isinstance(leaf.get("dtype"), str) and array_dtype(leaf["dtype"])
                and isinstance(leaf.get("shards"), list)):
            raise bad("a leaf entry is not {name, shape, dtype, sharding, shards}")
        shape = leaf["shape"]
        for region in leaf["shards"]:
            if not (isinstance(region, list) and len(region) == len(shape)
                    and all(isinstance(r, list) and len(r) == 2 and 0 <= r[0] <= r[1] <= n
                            for r, n in zip(region, shape))):
                raise bad(f"leaf {leaf['name']}: shard {region!r} is not inside its shape {shape}")
            offset += _nbytes(leaf, region)
    if offset != payload_bytes:
        raise bad(f"the shards need {offset} bytes, the payload has {payload_bytes}")


def _nbytes(leaf: dict, region) -> int:
    return int(np.prod([stop - start for start, stop in region], dtype=np.int64)) * np.dtype(leaf["dtype"]).itemsize


def shards(header: dict, payload: memoryview) -> dict[str, dict[tuple, np.ndarray]]:
    """Per leaf name, its shards by region, as host arrays viewing the payload."""
    out, offset = {}, 0
    for leaf in header["leaves"]:
        held = out[leaf["name"]] = {}
        for region in leaf["shards"]:
            n = _nbytes(leaf, region)
            extent = tuple(stop - start for start, stop in region)
            held[tuple(map(tuple, region))] = np.frombuffer(payload[offset:offset + n],
                                                            np.dtype(leaf["dtype"])).reshape(extent)
            offset += n
    return out


def assemble(header: dict, payload: memoryview, target, where: str):
    """`target`'s tree (arrays or ShapeDtypeStructs with shardings, or host values) rebuilt from the
    blob. Only the layout it was saved on: a leaf saved with another shape, dtype or sharding, or a
    device whose shard the blob lacks, is a CheckpointError (restore the persistent tier instead)."""
    names, leaves, treedef = named_leaves(target)
    saved = {leaf["name"]: leaf for leaf in header["leaves"]}
    held = shards(header, payload)
    if set(saved) != set(names):
        differ = sorted(set(saved) ^ set(names))
        raise CheckpointError(f"{where}: the saved tree differs from this run's ({', '.join(differ[:6])})")
    out = []
    for name, leaf in zip(names, leaves):
        shape, dtype, sharding = tuple(leaf.shape), np.dtype(leaf.dtype).name, getattr(leaf, "sharding", None)
        s = saved[name]
        if tuple(s["shape"]) != shape or s["dtype"] != dtype or s["sharding"] != sharding_json(sharding):
            raise CheckpointError(f"{where}: {name} was saved as {s['dtype']}{s['shape']} on {s['sharding']}, this "
                                  f"run has {dtype}{list(shape)} on {sharding_json(sharding)}: another layout")
        if sharding is None:
            out.append(held[name][tuple((0, d) for d in shape)].copy())
            continue
        parts = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            region = region_of(index, shape)
            if region not in held[name]:
                raise CheckpointError(f"{where}: {name} lacks the shard {list(region)} this process's devices hold")
            parts.append(jax.device_put(held[name][region], device, may_alias=False))
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
    return jax.tree_util.tree_unflatten(treedef, out)

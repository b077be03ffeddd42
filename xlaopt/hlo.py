"""Read collectives out of compiled (scheduled) HLO text.

Each collective is reported with its kind, bytes, replica groups, the mesh axes those groups
span, the topology link level they cross, its position in its computation's schedule and how
many times it runs per step (collectives inside a scanned layer's while body run once per
trip). An async pair (`-start` / `-done`) is one collective, counted at its `-start`.

Bytes follow the scaling-book convention, the size of the whole array the collective works on:
all-gather its result, reduce-scatter its operand, all-reduce and all-to-all their operand.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLS = re.compile(r"\b(?:body|condition|to_apply|calls)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    computation: str
    position: int  # index of the instruction in its computation's schedule
    is_async: bool
    bytes: int  # per execution, scaling-book convention (see module docstring)
    dtypes: tuple[str, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    executions: int  # per step: product of the trip counts of the loops around it
    mesh_axes: tuple[str, ...] = ()
    link_level: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a result type or tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def parse_replica_groups(attrs: str) -> tuple[tuple[int, ...], ...]:
    """`replica_groups={{0,1},{2,3}}` or the iota form `replica_groups=[2,4]<=[4,2]T(1,0)`."""
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        iota_shape = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(iota_shape))).reshape(iota_shape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(out_shape[0], -1))
    return ()


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line.strip())
            if m and "=" not in line.split("{")[0]:
                current = m.group(2)
                comps[current] = []
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps


def _executions(comps: dict[str, list[str]]) -> dict[str, int]:
    """How many times each computation runs per call of the entry (while bodies x trip count)."""
    runs: dict[str, int] = {}
    entry = next((name for name, lines in comps.items() if name.startswith("main") or "ENTRY" in name), None)
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, lines in comps.items():
        for line in lines:
            trips = 1
            if " while(" in line:
                m = _TRIP_COUNT.search(line)
                trips = int(m.group(1)) if m else 1
            for callee in _CALLS.findall(line):
                callers.setdefault(callee, []).append((name, trips))

    def count(name: str, depth: int = 0) -> int:
        if name in runs:
            return runs[name]
        if name not in callers or depth > 50:
            runs[name] = 1
            return 1
        runs[name] = sum(count(caller, depth + 1) * trips for caller, trips in callers[name])
        return runs[name]

    for name in comps:
        count(name)
    return runs


def collectives(hlo_text: str, mesh_shape: dict[str, int] | None = None, topology=None) -> list[Collective]:
    """Every collective in a compiled module, in schedule order within each computation."""
    comps = _computations(hlo_text)
    runs = _executions(comps)
    out = []
    for comp, lines in comps.items():
        for position, line in enumerate(lines):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result_type, op, rest = m.group(3), m.group(4), m.group(5)
            kind = op.removesuffix("-start")
            if kind not in KINDS or op.endswith("-done"):
                continue
            operands = rest.split("),", 1)[0]
            nbytes = shape_bytes(result_type) if kind == "all-gather" else shape_bytes(operands)
            if op.endswith("-start") and kind == "all-gather":
                nbytes = shape_bytes(result_type) - shape_bytes(operands)  # result tuple holds the operand too
            groups = parse_replica_groups(rest)
            out.append(Collective(
                name=m.group(2), kind=kind, computation=comp, position=position, is_async=op.endswith("-start"),
                bytes=nbytes, dtypes=tuple(sorted({d for d, _ in _SHAPE.findall(operands) if d in _DTYPE_BYTES})),
                replica_groups=groups, executions=runs.get(comp, 1),
                mesh_axes=group_axes(groups, mesh_shape) if mesh_shape else (),
                link_level=topology.level_of(groups[0]).name if topology is not None and groups else None))
    return out


def group_axes(groups: Sequence[Sequence[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of a replica group differ (partition ids are
    positions in the flattened mesh)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        varying |= {i for i in range(len(sizes)) if len(set(coords[:, i])) > 1}
    return tuple(names[i] for i in sorted(varying))


def bytes_by(colls: Sequence[Collective], key) -> dict:
    """Total bytes per step grouped by `key(collective)`."""
    out: dict = {}
    for c in colls:
        out[key(c)] = out.get(key(c), 0) + c.total_bytes
    return out

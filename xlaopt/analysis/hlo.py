"""Read compiled (scheduled) HLO text: its instructions, while-loop trip counts, collectives.

This is the one reader of HLO text the analysis uses: `parse` splits a module into its
computations' instructions, `trip_count` reads a while loop's known trip count, and
`read_collective` says which collective an instruction runs or starts; `xlaopt.analysis.schedule`
builds on all three.

`collectives` reports each collective with its kind, bytes, replica groups, the mesh axes those
groups span, the topology link level they cross, its position in its computation's schedule and
how many times it runs per step (collectives inside a scanned layer's while body run once per
trip). An async pair is one collective, counted at its start, never at its done: a `-start`
(`all-gather-start`, `all-reduce-start`, `collective-permute-start`) or an `async-start` whose
called computation holds the collective (`reduce-scatter`, `all-to-all`, ...).

Bytes follow the scaling-book convention, the size of the whole array the collective works on:
all-gather its result, reduce-scatter its operand, all-reduce and all-to-all their operand.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Every collective opcode (in its synchronous spelling): KINDS, whose bytes follow the
# scaling-book convention below, and two whose bytes are their result's.
COLLECTIVE_OPCODES = KINDS + ("collective-broadcast", "ragged-all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# An instruction line's groups: "ROOT " or None, name, result type, opcode, everything after `opcode(`.
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLS = re.compile(r"\b(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    computation: str
    position: int  # index of the instruction in its computation's schedule
    is_async: bool
    bytes: int  # per execution, scaling-book convention (see module docstring)
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result array
    replica_groups: tuple[tuple[int, ...], ...]
    executions: int  # per step: product of the trip counts of the loops around it
    mesh_axes: tuple[str, ...] = ()
    link_level: str | None = None

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions

    @property
    def scalar_bytes(self) -> int:
        """Bytes of rank-0 results (loss terms, token counts) within `bytes`, per execution."""
        return sum(DTYPE_BYTES[d] for d, dims in self.shapes if not dims)


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a result type or tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def shape_dims(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array shape in `text` (a result type or tuple of them)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(text) if d in DTYPE_BYTES]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(x) for x in dims.split(",") if x]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def parse_replica_groups(attrs: str) -> tuple[tuple[int, ...], ...]:
    """Replica groups in any of XLA's spellings:
    explicit `{{0,1},{2,3}}`; iota `[2,4]<=[4,2]T(1,0)`; and the mesh form
    `mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}` (device_ids
    optional, default iota), whose groups vary along the braced axes."""
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        groups = int(m.group(1).split(",")[0])
        return tuple(tuple(int(x) for x in row) for row in _iota(m.group(2), m.group(3)).reshape(groups, -1))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?|[0-9,\s]*)\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        devices = np.arange(int(np.prod(sizes)))
        if m.group(2):
            d = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", m.group(2))
            devices = _iota(d.group(1), d.group(2)).ravel() if d else np.array(
                [int(x) for x in m.group(2).split(",") if x.strip()])
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        rest = [i for i in range(len(names)) if i not in grouped]
        arranged = devices.reshape(sizes).transpose(rest + grouped)
        size = int(np.prod([sizes[i] for i in grouped]))
        return tuple(tuple(int(x) for x in row) for row in arranged.reshape(-1, size))
    m = re.search(r"source_target_pairs=\"?\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m:  # collective-permute, or send / recv's frontend attribute: each (source, target) pair is a group
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    return ()


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """Instruction lines per computation, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
                head = line.split("(", 1)[0].split()
                is_entry = head[0] == "ENTRY"
                current = head[-1].lstrip("%")
                comps[current] = []
                entry = current if is_entry else entry
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction line of a compiled computation, split into its parts."""
    name: str
    result: str  # result type text
    opcode: str
    operands: tuple[str, ...]
    args: str  # the text inside the parentheses (a parameter's index, a constant's value)
    attrs: str
    is_root: bool


def _split_operands(rest: str) -> tuple[str, str]:
    """`rest` is everything after `opcode(`: return (operand text, attribute text)."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:]
    return rest, ""


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Each computation's instructions, in schedule order, and the entry computation's name."""
    comps, entry = computations(hlo_text)
    parsed: dict[str, list[Instruction]] = {}
    for comp, lines in comps.items():
        instrs = []
        for line in lines:
            m = INSTRUCTION.match(line)
            if not m:
                continue
            operand_text, attrs = _split_operands(m.group(5))
            instrs.append(Instruction(m.group(2), m.group(3), m.group(4), tuple(_OPERAND.findall(operand_text)),
                                      operand_text, attrs, bool(m.group(1))))
        parsed[comp] = instrs
    return parsed, entry


def trip_count(attrs: str) -> int | None:
    """A while loop's trip count from its attribute text (XLA's backend_config
    `known_trip_count`), or None when XLA does not know it."""
    m = TRIP_COUNT.search(attrs)
    if m:
        return int(m.group(1))
    m = re.search(r"backend_config=(\{.*\})", attrs)
    if m:
        try:
            return int(json.loads(m.group(1))["known_trip_count"]["n"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


def loop_trip_count(loop: Instruction, comp: str, comps: dict[str, list[Instruction]]) -> int | None:
    """A while loop's trip count (`loop` an instruction of computation `comp`): XLA's own where
    it gives one, else read from the loop itself (`_counted_trips`), else None."""
    known = trip_count(loop.attrs)
    return known if known is not None else _counted_trips(loop, comp, comps)


def _counted_trips(loop: Instruction, comp: str, comps: dict[str, list[Instruction]]) -> int | None:
    """The trip count of a loop of the form `for (i = a; i < b; i += s)` with constants a, b, s,
    from its start value, condition and body. XLA's GPU pipeline peels the first iteration of
    some loops (a scan over micro-batches) and the rest loses `known_trip_count`; counted as
    once, the step's work was undercounted by the micro-batch count."""
    cond, body = _callee(loop, "condition"), _callee(loop, "body")
    if cond not in comps or body not in comps or len(loop.operands) != 1:
        return None
    compare = _root_value(cond, comps)
    if compare is None or compare[0] != "compare":
        return None
    _, direction, lhs, rhs = compare
    if direction in ("GT", "GE"):  # b > i: the same bound read the other way round
        lhs, rhs, direction = rhs, lhs, {"GT": "LT", "GE": "LE"}[direction]
    if direction not in ("LT", "LE") or lhs[0] != "element" or rhs[0] != "constant":
        return None
    index = lhs[1]
    step = _tuple_element_value(body, index, comps)
    start = _value(comp, _tuple_operand(comp, loop.operands[0], index, comps), comps, {})
    if step is None or start is None or start[0] != "constant":
        return None
    if not (step[0] == "add" and step[1] == ("element", index) and step[2][0] == "constant" and step[2][1] > 0):
        return None
    bound = rhs[1] + (1 if direction == "LE" else 0)
    return max(0, -(-(bound - start[1]) // step[2][1]))


def _callee(ins: Instruction, key: str) -> str | None:
    m = re.search(key + r"=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def _tuple_operand(comp: str, name: str, index: int, comps: dict[str, list[Instruction]]) -> str | None:
    """The `index`-th operand of the tuple instruction `name` (through copies), or None."""
    ins = _resolved(comp, name, comps)
    return ins.operands[index] if ins is not None and ins.opcode == "tuple" and index < len(ins.operands) else None


def _resolved(comp: str, name: str | None, comps: dict[str, list[Instruction]]) -> Instruction | None:
    by_name = {i.name: i for i in comps.get(comp, [])}
    ins = by_name.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
        ins = by_name.get(ins.operands[0])
    return ins


def _root_value(comp: str, comps: dict[str, list[Instruction]]):
    root = next((i for i in comps.get(comp, []) if i.is_root), None)
    return None if root is None else _value(comp, root.name, comps, {})


def _tuple_element_value(comp: str, index: int, comps: dict[str, list[Instruction]]):
    root = next((i for i in comps.get(comp, []) if i.is_root), None)
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    return _value(comp, root.operands[index], comps, {})


def _value(comp: str, name: str | None, comps: dict[str, list[Instruction]], params: dict, depth: int = 0):
    """A scalar integer instruction as a small expression: ("constant", v), ("element", k) for
    element k of the computation's tuple parameter, ("add", a, b), ("compare", direction, a, b);
    through copies and into fusions (`params`: a fusion's parameter numbers to their values)."""
    ins = _resolved(comp, name, comps)
    if ins is None or depth > 8:
        return None
    if ins.opcode == "constant":
        try:
            return ("constant", int(ins.args))
        except ValueError:
            return None
    if ins.opcode == "parameter":
        return params.get(int(ins.args)) if ins.args.isdigit() else None
    if ins.opcode == "get-tuple-element":
        source = _resolved(comp, ins.operands[0], comps) if ins.operands else None
        m = re.search(r"index=(\d+)", ins.attrs)
        return ("element", int(m.group(1))) if source is not None and source.opcode == "parameter" and m else None
    if ins.opcode == "fusion":
        fused = _callee(ins, "calls")
        inner = {k: _value(comp, o, comps, params, depth + 1) for k, o in enumerate(ins.operands)}
        root = next((i for i in comps.get(fused, []) if i.is_root), None)
        return None if root is None else _value(fused, root.name, comps, inner, depth + 1)
    operands = [_value(comp, o, comps, params, depth + 1) for o in ins.operands]
    if any(o is None for o in operands) or len(operands) != 2:
        return None
    if ins.opcode == "add":
        a, b = operands
        return ("add", b, a) if a[0] == "constant" else ("add", a, b)
    if ins.opcode == "compare":
        m = re.search(r"direction=(\w+)", ins.attrs)
        return ("compare", m.group(1), *operands) if m else None
    return None


def _executions(comps: dict[str, list[Instruction]]) -> dict[str, int]:
    """How many times each computation runs per call of the entry (while bodies x trip count)."""
    runs: dict[str, int] = {}
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, instrs in comps.items():
        for ins in instrs:
            trips = (loop_trip_count(ins, name, comps) or 1) if ins.opcode == "while" else 1
            for callee in _CALLS.findall(ins.attrs):
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


@dataclasses.dataclass(frozen=True)
class CollectiveRead:
    """What `read_collective` finds: the collective's kind (the `-start` dropped), whether it is
    the start of an async pair, the instruction that holds its groups and result (the one read,
    or the collective an `async-start` calls), its replica groups and bytes per execution."""
    kind: str
    is_async: bool
    target: Instruction
    replica_groups: tuple[tuple[int, ...], ...]
    bytes: int

    @property
    def group_size(self) -> int:
        return len(self.replica_groups[0]) if self.replica_groups else 1


def read_collective(ins: Instruction, comps: dict[str, list[Instruction]]) -> CollectiveRead | None:
    """The collective `ins` runs or starts: a collective opcode, its `-start`, or an `async-start`
    whose called computation (in `comps`, from `parse`) holds one. None for anything else, every
    `-done` and `async-done` included: an async pair is read once, at its start."""
    if ins.opcode == "async-start":
        m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        target = next((i for i in comps.get(m.group(1), ()) if i.opcode in COLLECTIVE_OPCODES), None) if m else None
        if target is None:  # an async computation that is not a collective
            return None
        is_async = True
    elif ins.opcode in COLLECTIVE_OPCODES:
        target, is_async = ins, False
    elif ins.opcode.endswith("-start") and ins.opcode.removesuffix("-start") in COLLECTIVE_OPCODES:
        target, is_async = ins, True
    else:
        return None
    op = target.opcode
    kind = op.removesuffix("-start")
    groups = parse_replica_groups(target.attrs)
    size = len(groups[0]) if groups else 1
    nbytes = collective_bytes(kind, op, target.result, size) if kind in KINDS else shape_bytes(target.result)
    return CollectiveRead(kind, is_async, target, groups, nbytes)


def async_computations(comps: dict[str, list[Instruction]]) -> set[str]:
    """The computations `async-start`s call: their instructions run as part of the start."""
    return {m.group(1) for instrs in comps.values() for ins in instrs if ins.opcode == "async-start"
            for m in [re.search(r"calls=%?([\w.\-]+)", ins.attrs)] if m}


COMPUTE_OPCODES = ("fusion", "custom-call", "convolution", "dot")


def compute_inside_async(hlo_text: str, kind: str) -> list[int]:
    """For each async `kind` (e.g. all-to-all: its `-start` / `-done` pair) of a scheduled
    program, how many compute instructions the schedule runs between its start and its done:
    0 means the transfer is exposed unless something else hides it."""
    comps, _ = parse(hlo_text)
    windows = []
    for instrs in comps.values():
        for i, start in enumerate(instrs):
            if start.opcode != f"{kind}-start":
                continue
            done = next(j for j in range(i + 1, len(instrs))
                        if instrs[j].opcode == f"{kind}-done" and start.name in instrs[j].operands)
            windows.append(sum(x.opcode in COMPUTE_OPCODES for x in instrs[i + 1:done]))
    return windows


def collectives(hlo_text: str, mesh_shape: dict[str, int] | None = None, topology=None) -> list[Collective]:
    """Every collective in a compiled module, in schedule order within each computation."""
    comps, _ = parse(hlo_text)
    runs = _executions(comps)
    wrapped = async_computations(comps)  # read through their async-start, not a second time
    out = []
    for comp, instrs in comps.items():
        if comp in wrapped:
            continue
        for position, ins in enumerate(instrs):
            c = read_collective(ins, comps)
            if c is None:
                continue
            groups = c.replica_groups
            out.append(Collective(
                name=ins.name, kind=c.kind, computation=comp, position=position, is_async=c.is_async,
                bytes=c.bytes, shapes=tuple(shape_dims(c.target.result)),
                replica_groups=groups, executions=runs.get(comp, 1),
                mesh_axes=group_axes(groups, mesh_shape) if mesh_shape else (),
                link_level=topology.level_of(groups[0]).name if topology is not None and groups else None))
    return out


def collective_bytes(kind: str, op: str, result_type: str, group_size: int) -> int:
    """Compiled HLO names operands without their types, so bytes come from the result type."""
    if op.endswith("-start") and kind in ("all-gather", "reduce-scatter") and (
            kind == "reduce-scatter" or result_type.lstrip().startswith("((")):
        # A (combined) async result is ((operands...), (results...)): results are n times the
        # operands for a gather, 1/n of them for a scatter; V is the larger side in both.
        return shape_bytes(result_type) * group_size // (group_size + 1)
    if op.endswith("-start") and kind in ("all-gather", "collective-permute"):
        # The async result is a tuple (operand, result[, scratch]): the largest is the result.
        return max((shape_bytes(f"{d}[{dims}]") for d, dims in _SHAPE.findall(result_type)), default=0)
    if kind == "reduce-scatter":
        return shape_bytes(result_type) * group_size
    return shape_bytes(result_type)


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


_LOCATION_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_STACK_FRAME = re.compile(r"\s*stack_frame_id=\d+")


def without_source_locations(hlo_text: str) -> str:
    """The module's text without its source-location tables and the instructions' references to
    them: the tables' order follows Python's hash seed, so two processes compiling one program
    print them differently while every instruction is the same."""
    kept, skipping = [], False
    for line in hlo_text.splitlines():
        if line in _LOCATION_TABLES:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(_STACK_FRAME.sub("", line))
    return "\n".join(kept)


_GEMM_FUSION_PARAMS = re.compile(r"gemm_fusion\S*_computation \(([^)]*)\)")


def fp8_gemms(text: str) -> int:
    """GEMMs in compiled GPU HLO that read fp8 operands: Triton GEMM fusions whose parameters
    are fp8 and cuBLASLt's fp8 calls (each counted once per computation, not per trip)."""
    triton = sum("f8e" in params for params in _GEMM_FUSION_PARAMS.findall(text))
    return triton + text.count('custom_call_target="__cublas$lt$matmul$f8"')

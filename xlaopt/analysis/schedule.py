"""The scheduled instruction stream of a compiled step, op by op, ready to be simulated.

`build_schedule(hlo_text)` reads XLA's scheduled HLO (`compiled.as_text()`: each computation's
instructions are printed in schedule order) and returns the entry computation's ops in execution
order, with every while loop's body repeated by its known trip count (exactly expanded, not
priced once and multiplied; a loop XLA cannot count, by the trip count the caller gives its name
scope, else once), `call`s inlined, and a `conditional` replaced by its branch with the
most matmul FLOPs (an upper bound; the branch taken is not known statically), or, where the
caller says which branch some device takes at each trip of the loop around it (1F1B's forward,
tail and backward, `PipelineSchedule.taken_at`), by that.

Each op carries:
- kind: "compute", "collective" (synchronous: the compute stream waits for it),
  "collective-start" / "collective-done" (an async pair: `all-gather-start`, `all-reduce-start`,
  `collective-permute-start`, or `async-start` wrapping a `reduce-scatter` / `all-to-all`),
  "send" / "recv" / "send-done" / "recv-done" (point-to-point transfers, their source-target
  pairs as the groups), "copy-start" / "copy-done" (an async copy, `host_transfer` when one side
  is host memory), or "free" (parameter, constant, tuple plumbing, bitcast: no work);
- flops: matmul FLOPs, per device, from shapes: a dot is 2 * prod(result dims) * prod(lhs
  contracting dims); a convolution 2 * prod(result) * prod(kernel) / output features (its cuDNN
  custom calls, forward and both gradients, the same from the forward's shapes); a fusion the
  sum over the dots in its fused computation; a cuBLAS gemm custom call from its dot dimension
  numbers; a custom call of a name scope and target the caller gives FLOPs for (cuDNN's fused
  attention, which XLA counts as none), those, marked `fused_attention`. Elementwise arithmetic is not counted (it is memory-bound and priced by bytes);
- bytes: memory traffic, operand + result sizes; a slice read inside a fusion (dynamic-slice of a
  parameter) counts the slice, an in-place dynamic-update-slice counts the update, not the buffer;
- for collectives: kind, bytes in the scaling-book convention of `xlaopt.analysis.hlo`, replica groups, and
  `narrow_bytes`: the bytes if every operand that is a widening convert (bf16 -> f32) travelled in
  its narrow type. XLA's CPU pipeline widens bf16 collectives to f32 (a gather of a bf16 weight
  becomes a gather of its f32 re-widening); a GPU compile moves the bf16. `xlaopt.analysis.simulate` can
  price either.

`Schedule.async_windows()` lists, for every async collective, what the schedule places between
its start and its done (ops, compute ops, matmul FLOPs, bytes): the compute the scheduler gave it
to hide behind.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, Iterator

from xlaopt.analysis import hlo
from xlaopt.analysis.hlo import Instruction
from xlaopt.analysis.hlo_costs import FREE_OPCODES, CollectiveInfo, HloReader

# Async transfers that are not collectives: their op kind is their opcode.
TRANSFER_OPCODES = frozenset({"copy-start", "copy-done", "send", "recv", "send-done", "recv-done"})
_HOST_MEMORY = re.compile(r"S\(5\)")  # XLA's host memory space, in a layout: f32[8]{0:S(5)}


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    opcode: str
    kind: str  # compute | collective | collective-start | collective-done | one of TRANSFER_OPCODES | free
    computation: str
    position: int  # index in its computation's schedule
    flops: float = 0.0
    bytes: int = 0  # a copy-start: the bytes of the array it copies
    matmuls: tuple[float, ...] = ()  # FLOPs of each matmul inside (efficiency depends on size)
    dtype: str | None = None  # element type of the matmul operands, e.g. "bf16"
    collective: CollectiveInfo | None = None
    operands: tuple[str, ...] = ()
    # A fusion that only widens a value it first narrowed (f32 -> bf16 -> f32): XLA's CPU pipeline
    # emits these around bf16 work it runs in f32; a GPU compile has no such op.
    widening_roundtrip: bool = False
    # copy-start / send / recv between host and device memory (a memory space S(5) layout, or
    # is_host_transfer=true) rather than inside device memory or between devices.
    host_transfer: bool = False
    # The op stands for this many runs of itself (a data-dependent loop's body priced once per
    # op): flops and bytes are the total over the runs, `matmuls` the sizes of one run's.
    repeat: int = 1
    # A fused attention kernel (cuDNN's custom call) whose FLOPs the caller gave (XLA counts none):
    # priced at fused attention's efficiency, not by the matmul size curve.
    fused_attention: bool = False
    # The name scope of the `build_schedule(branch_taken=...)` rule whose branch this op ran in.
    branch: str = ""


@dataclasses.dataclass
class Schedule:
    ops: list[Op]  # entry computation in execution order, loops expanded
    entry: str
    loops: list[dict]  # {name, computation, body, trip_count, known}; an entry-level loop also `ops`: [first, end)
    templates: dict[str, list[Op]]  # each expanded computation's ops, in schedule order

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

    @functools.cached_property  # read by every simulation of the schedule (a refit runs hundreds)
    def branch_spans(self) -> dict[str, list[tuple[int, int]]]:
        """{name scope: [first, end) runs of `ops`} for the ops each branch rule chose."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for i, op in enumerate(self.ops):
            if not op.branch:
                continue
            runs = spans.setdefault(op.branch, [])
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return spans

    def async_windows(self) -> list[dict]:
        """For each async collective (per instruction, not per execution): the ops the schedule
        places between its start and its done, in the computation that holds both."""
        out = []
        for comp, ops in self.templates.items():
            starts: dict[str, int] = {}
            for i, op in enumerate(ops):
                if op.kind == "collective-start":
                    starts[op.name] = i
                elif op.kind == "collective-done":
                    start = next((s for s in op.operands if s in starts), None)
                    if start is None:
                        continue
                    j = starts.pop(start)
                    between = [o for o in ops[j + 1:i] if o.kind != "free"]
                    c = ops[j].collective
                    out.append({"start": start, "done": op.name, "computation": comp, "kind": c.kind,
                                "bytes": c.bytes, "ops_between": len(between),
                                "compute_ops_between": sum(o.kind == "compute" for o in between),
                                "collectives_between": sum(o.kind != "compute" for o in between),
                                "flops_between": sum(o.flops for o in between),
                                "bytes_between": sum(o.bytes for o in between if o.kind == "compute")})
            for name in starts:  # done in a later iteration (pipelined) or not in this computation
                c = ops[starts[name]].collective
                out.append({"start": name, "done": None, "computation": comp, "kind": c.kind, "bytes": c.bytes,
                            "ops_between": None, "compute_ops_between": None, "collectives_between": None,
                            "flops_between": None, "bytes_between": None})
        return out


def _op(reader: HloReader, comp: str, position: int, ins: Instruction) -> Op:
    base = dict(name=ins.name, opcode=ins.opcode, computation=comp, position=position, operands=ins.operands)
    if ins.opcode in FREE_OPCODES:
        return Op(kind="free", **base)
    if ins.opcode in TRANSFER_OPCODES:
        return _transfer(reader, comp, ins, base)
    if ins.opcode.endswith("-done"):
        return Op(kind="collective-done", **base)
    info = reader.collective(comp, ins)
    if info is not None:
        kind = "collective" if ins.opcode in hlo.COLLECTIVE_OPCODES else "collective-start"
        return Op(kind=kind, collective=info, **base)
    matmuls, dtype = reader.matmuls(comp, ins)
    roundtrip = ins.opcode == "fusion" and reader.is_roundtrip(reader.callee(ins, "calls"))
    return Op(kind="compute", flops=float(sum(matmuls)), bytes=reader.op_bytes(comp, ins), matmuls=matmuls,
              dtype=dtype, widening_roundtrip=roundtrip, **base)


def _transfer(reader: HloReader, comp: str, ins: Instruction, base: dict) -> Op:
    """copy-start (its bytes: the copied operand), send / recv (their bytes: the data array,
    first in their result (data, context, token); their groups: the source-target pairs), and
    their dones."""
    if ins.opcode == "copy-start":
        source = reader.types[comp].get(ins.operands[0], "") if ins.operands else ""
        host = bool(_HOST_MEMORY.search(ins.result) or _HOST_MEMORY.search(source))
        return Op(kind="copy-start", bytes=hlo.shape_bytes(source), host_transfer=host, **base)
    if ins.opcode in ("send", "recv"):
        data = hlo.shape_dims(ins.result)[:1]
        nbytes = sum(hlo.DTYPE_BYTES[d] * math.prod(dims) for d, dims in data)
        info = CollectiveInfo(ins.opcode, nbytes, nbytes, hlo.parse_replica_groups(ins.attrs))
        return Op(kind=ins.opcode, collective=info, host_transfer="is_host_transfer=true" in ins.attrs, **base)
    return Op(kind=ins.opcode, **base)


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _loop_trips(attrs: str, loop_trips: dict[str, int]) -> int | None:
    """The trip count a caller gives the while loop of these attributes: the loop's op_name ends in
    `<tag>/while` for one of the tags (the name scope data-dependent loops are traced under)."""
    m = _OP_NAME.search(attrs)
    if m is None:
        return None
    for tag, trips in loop_trips.items():
        if m.group(1).endswith(f"{tag}/while"):
            return trips
    return None


_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def _given_flops(ins: Instruction, custom_call_flops: dict[str, dict[str, float]]) -> float | None:
    """The FLOPs a caller gives a custom call: by a name scope in its op_name, then its target."""
    target, name = _TARGET.search(ins.attrs), _OP_NAME.search(ins.attrs)
    if ins.opcode != "custom-call" or target is None or name is None:
        return None
    scopes = name.group(1).split("/")
    return next((by_target[target.group(1)] for tag, by_target in custom_call_flops.items()
                 if tag in scopes and target.group(1) in by_target), None)


def _taken_by(attrs: str, branch_taken: dict[str, Callable[[int], bool]]) -> tuple[str, Callable[[int], bool]] | None:
    """(name scope, the caller's rule) for a conditional traced under one of `branch_taken`'s scopes."""
    m = _OP_NAME.search(attrs)
    scopes = m.group(1).split("/") if m else ()
    return next(((tag, rule) for tag, rule in branch_taken.items() if tag in scopes), None)


def _ruled_branch(branches: list[str], taken: bool, busiest_of: dict, flops_of: Callable[[str], float]) -> str:
    """The branch a `branch_taken` rule runs: not taken, branch 0; taken, the other one, or of a
    switch's others the one of the most FLOPs (found once, at its first trip, into `busiest_of`)."""
    if not taken:
        return branches[0]
    others = tuple(branches[1:])
    if others not in busiest_of:
        flops = [flops_of(b) for b in others] if len(others) > 1 else [0.0]
        busiest_of[others] = others[flops.index(max(flops))]
    return busiest_of[others]


def _busiest(expanded: list[list[Op]]) -> list[Op]:
    """The branch with the most FLOPs, its loops' as well as its own ops' (each expanded once)."""
    return max(expanded, key=lambda branch_ops: sum(o.flops for o in branch_ops))


def build_schedule(hlo_text: str, loop_trips: dict[str, int] | None = None,
                   custom_call_flops: dict[str, dict[str, float]] | None = None,
                   branch_taken: dict[str, Callable[[int], bool]] | None = None) -> Schedule:
    """The entry computation's ops in execution order (see the module docstring).
    `loop_trips`: trip counts of loops XLA cannot know, by the name scope they were traced under
    (segment-aware attention's pair loops: as many trips as the priced batch's block pairs).
    `custom_call_flops`: {name scope: {custom call target: FLOPs of one run}} for custom calls
    XLA counts no FLOPs for (cuDNN's fused attention, forward and backward).
    `branch_taken`: {name scope: trip -> whether the true branch runs} for a conditional inside a
    loop, at each trip of that loop (the busiest device's branch); of a switch, whether one of the
    branches after the first runs (the busiest of them), or the first."""
    reader = HloReader(hlo_text)
    if reader.entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    templates: dict[str, list[Op]] = {}
    loops: list[dict] = []
    seen_loops: set[str] = set()
    busiest_of: dict[tuple[str, ...], str] = {}

    def template(comp: str) -> list[Op]:
        if comp not in templates:
            templates[comp] = [_op(reader, comp, i, ins) for i, ins in enumerate(reader.comps.get(comp, []))]
            for i, ins in enumerate(reader.comps.get(comp, [])) if custom_call_flops else ():
                given = _given_flops(ins, custom_call_flops)
                if given is not None:
                    templates[comp][i] = dataclasses.replace(templates[comp][i], flops=given, matmuls=(given,),
                                                             fused_attention=True)
        return templates[comp]

    def expand(comp: str, depth: int = 0, trip: int = 0) -> Iterator[Op]:
        if depth > 64:
            raise ValueError(f"computation nesting deeper than 64 at {comp}")
        for ins, op in zip(reader.comps.get(comp, []), template(comp)):
            yield from expand_one(ins, op, comp, depth, trip)

    def expand_one(ins: Instruction, op: Op, comp: str, depth: int, trip: int = 0) -> Iterator[Op]:
        if ins.opcode == "while":
            body = reader.callee(ins, "body")
            trips = hlo.loop_trip_count(ins, comp, reader.comps)
            given = _loop_trips(ins.attrs, loop_trips or {}) if trips is None else None
            runs = trips if trips is not None else given if given is not None else 1
            if ins.name not in seen_loops:
                seen_loops.add(ins.name)
                loops.append({"name": ins.name, "computation": comp, "body": body, "trip_count": runs,
                              "known": trips is not None, "given": given is not None})
            body_ops = list(expand(body, depth + 1)) if given is not None else None
            if body_ops is not None and all(o.kind in ("compute", "free") for o in body_ops):
                # A loop of the caller's count within one device (no communication): each body
                # op once, standing for its `runs` runs, so a long pair loop is priced in one pass.
                yield from (dataclasses.replace(o, flops=o.flops * runs, bytes=o.bytes * runs, repeat=o.repeat * runs)
                            for o in body_ops if runs)
                return
            for i in range(runs):
                yield from expand(body, depth + 1, i)
        elif ins.opcode == "call":
            yield from expand(reader.callee(ins, "to_apply"), depth + 1, trip)
        elif ins.opcode == "conditional":
            m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            # (false, true): a boolean predicate's index is 0 or 1
            branches = [b.strip().lstrip("%") for b in m.group(1).split(",")] if m else \
                [c for c in (reader.callee(ins, "false_computation"), reader.callee(ins, "true_computation")) if c]
            ruled = _taken_by(ins.attrs, branch_taken or {}) if len(branches) >= 2 else None
            if ruled is not None:  # not taken: branch 0; taken: one of the others (a switch's: the busiest)
                tag, rule = ruled
                chosen = _ruled_branch(branches, rule(trip), busiest_of,
                                       lambda b: sum(o.flops for o in expand(b, depth + 1, trip)))
                yield from (o if o.branch else dataclasses.replace(o, branch=tag)
                            for o in expand(chosen, depth + 1, trip))
            elif branches:
                yield from _busiest([list(expand(b, depth + 1, trip)) for b in branches])
        else:
            yield op

    ops: list[Op] = []
    for ins, op in zip(reader.comps.get(reader.entry, []), template(reader.entry)):  # entry loops: their ops' span
        first = len(ops)
        ops.extend(expand_one(ins, op, reader.entry, 0))
        if ins.opcode == "while":
            next(loop for loop in loops if loop["name"] == ins.name)["ops"] = [first, len(ops)]
    return Schedule(ops=ops, entry=reader.entry, loops=loops, templates=templates)

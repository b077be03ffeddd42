"""The scheduled instruction stream of a compiled step, op by op, ready to be simulated.

`build_schedule(hlo_text)` reads XLA's scheduled HLO (`compiled.as_text()`: each computation's
instructions are printed in schedule order) and returns the entry computation's ops in execution
order, with every while loop's body repeated by its known trip count (exactly expanded, not
priced once and multiplied; a loop XLA cannot count, by the trip count the caller gives its name
scope, else once), `call`s inlined, and a `conditional` replaced by its branch with the
most matmul FLOPs (an upper bound; the branch taken is not known statically).

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
from typing import Iterator

from xlaopt.analysis import hlo
from xlaopt.analysis.hlo import Instruction

FREE_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id", "after-all",
    "add-dependency", "opt-barrier", "domain", "while", "call", "conditional",
})
# Async transfers that are not collectives: their op kind is their opcode.
TRANSFER_OPCODES = frozenset({"copy-start", "copy-done", "send", "recv", "send-done", "recv-done"})
_HOST_MEMORY = re.compile(r"S\(5\)")  # XLA's host memory space, in a layout: f32[8]{0:S(5)}
_DOT_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    kind: str  # one of hlo.COLLECTIVE_OPCODES (the `-start` suffix dropped)
    bytes: int  # per execution, scaling-book convention (see xlaopt.analysis.hlo)
    narrow_bytes: int  # the same with widening converts undone (see module docstring)
    replica_groups: tuple[tuple[int, ...], ...]
    # All-reduce only: the fraction of its bytes whose every use keeps only this device's 1/n
    # slice (a dynamic-slice by partition): a reduce-scatter in all but name. XLA's CPU pipeline
    # leaves FSDP gradient reductions in this form; GPU pipelines rewrite them to reduce-scatter.
    scattered_fraction: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.replica_groups[0]) if self.replica_groups else 1


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


@dataclasses.dataclass
class Schedule:
    ops: list[Op]  # entry computation in execution order, loops expanded
    entry: str
    loops: list[dict]  # {name, computation, body, trip_count, known}
    templates: dict[str, list[Op]]  # each expanded computation's ops, in schedule order

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

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


def _int_list(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([0-9,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []



def _per_instance(method):
    """`functools.cache` for a method, held by the instance: a cache on the class would keep
    every reader (and its whole module text) alive for as long as the process runs."""
    key = "_memo_" + method.__name__

    @functools.wraps(method)
    def cached(self, *args):
        memo = self.__dict__.setdefault(key, {})
        if args not in memo:
            memo[args] = method(self, *args)
        return memo[args]

    return cached

class HloReader:
    """A compiled module's instructions per computation (`comps`, in schedule order), each
    computation's result types by instruction name (`types`), and the entry's name (`entry`)."""

    def __init__(self, hlo_text: str):
        self.comps, self.entry = hlo.parse(hlo_text)
        self.types = {c: {i.name: i.result for i in instrs} for c, instrs in self.comps.items()}

    # --- FLOPs -------------------------------------------------------------------------
    def _dot(self, comp: str, ins: Instruction) -> tuple[float, str | None]:
        lhs = hlo.shape_dims(self.types[comp].get(ins.operands[0], "")) if ins.operands else []
        out = hlo.shape_dims(ins.result)
        if not lhs or not out:
            return 0.0, None
        contracting = math.prod(lhs[0][1][d] for d in _int_list(ins.attrs, "lhs_contracting_dims"))
        return 2.0 * math.prod(out[0][1]) * contracting, lhs[0][0]

    def _convolution(self, comp: str, ins: Instruction) -> tuple[float, str | None]:
        """A convolution, or one of the cuDNN custom calls XLA's GPU pipeline rewrites it and its
        gradients into. These keep the forward convolution's `dim_labels`, but their operands and
        result play other parts: (input, kernel) -> output forward, (output grad, kernel) -> input
        grad, (input, output grad) -> kernel grad; each does the forward's FLOPs."""
        if len(ins.operands) < 2:
            return 0.0, None
        operand = lambda i: hlo.shape_dims(self.types[comp].get(ins.operands[i], ""))
        result = hlo.shape_dims(ins.result)
        target = re.search(r'custom_call_target="__cudnn\$conv(\w+)"', ins.attrs)
        kind = target.group(1) if target else "Forward"  # convForward, or convBiasActivationForward: fused epilogue
        kernel, out = {"BackwardInput": (operand(1), operand(0)),
                       "BackwardFilter": (result, operand(1))}.get(kind, (operand(1), result))
        m = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
        if not kernel or not out or not m or "o" not in m.group(1):
            return 0.0, None
        dims = kernel[0][1]
        per_output = math.prod(dims) / dims[m.group(1).index("o")]
        return 2.0 * math.prod(out[0][1]) * per_output, operand(0)[0][0] if operand(0) else None

    def _gemm_custom_call(self, comp: str, ins: Instruction) -> tuple[float, str | None]:
        m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attrs)
        lhs = hlo.shape_dims(self.types[comp].get(ins.operands[0], "")) if ins.operands else []
        out = hlo.shape_dims(ins.result)
        if not m or not lhs or not out:
            return 0.0, None
        dims = [int(x.strip().strip('"')) for x in m.group(1).split(",") if x.strip()]
        return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims), lhs[0][0]

    def matmuls(self, comp: str, ins: Instruction) -> tuple[tuple[float, ...], str | None]:
        if ins.opcode == "dot":
            f, dtype = self._dot(comp, ins)
            return ((f,) if f else ()), dtype
        if ins.opcode == "convolution" or (ins.opcode == "custom-call" and '"__cudnn$conv' in ins.attrs):
            f, dtype = self._convolution(comp, ins)
            return ((f,) if f else ()), dtype
        if ins.opcode == "custom-call" and any(f'custom_call_target="{t}"' in ins.attrs for t in _DOT_TARGETS):
            f, dtype = self._gemm_custom_call(comp, ins)
            return ((f,) if f else ()), dtype
        if ins.opcode == "fusion":
            callee = self.callee(ins, "calls")
            if callee:
                return self._fused_matmuls(callee)
        return (), None

    @_per_instance
    def _fused_matmuls(self, comp: str) -> tuple[tuple[float, ...], str | None]:
        found: list[float] = []
        dtype = None
        for ins in self.comps.get(comp, ()):
            fl, dt = self.matmuls(comp, ins)
            found.extend(fl)
            dtype = dtype or dt
        return tuple(found), dtype

    @staticmethod
    def callee(ins: Instruction, key: str) -> str | None:
        """The computation `ins` names in its `key` attribute (calls, body, to_apply, ...)."""
        m = re.search(key + r"=%?([\w.\-]+)", ins.attrs)
        return m.group(1) if m else None

    # --- bytes -------------------------------------------------------------------------
    def operand_bytes(self, comp: str, ins: Instruction) -> list[int]:
        """Bytes of each operand of `ins`, an instruction of computation `comp`."""
        return [hlo.shape_bytes(self.types[comp].get(o, "")) for o in ins.operands]

    @_per_instance
    def _fusion_access(self, comp: str) -> tuple[dict[int, int], int | None]:
        """For a fused computation: parameter index -> bytes actually touched (a parameter read
        only through dynamic-slices, bitcasts aside, counts the slices; the buffer of an in-place
        dynamic-update-slice counts 0), and the bytes written when the root updates in place."""
        instrs = self.comps.get(comp, [])
        params = {}
        for ins in instrs:
            if ins.opcode == "parameter":
                m = re.match(r"\s*(\d+)", ins.args)
                idx = int(m.group(1)) if m else len(params)
                params[ins.name] = idx
        users: dict[str, list[tuple[Instruction, int]]] = {}
        for ins in instrs:
            for k, o in enumerate(ins.operands):
                users.setdefault(o, []).append((ins, k))
        def through_bitcasts(name: str) -> list[tuple[Instruction, int]]:
            # A bitcast only renames the buffer (a layout the loop carries, e.g. a transposed V
            # cache): what touches the bytes is what uses the bitcast.
            out = []
            for u, k in users.get(name, []):
                out += through_bitcasts(u.name) if u.opcode == "bitcast" else [(u, k)]
            return out

        access: dict[int, int] = {}
        for name, idx in params.items():
            uses = through_bitcasts(name)
            if uses and all(u.opcode == "dynamic-slice" and k == 0 for u, k in uses):
                access[idx] = sum(hlo.shape_bytes(u.result) for u, _ in uses)
            elif uses and all(u.opcode == "dynamic-update-slice" and k == 0 for u, k in uses):
                access[idx] = 0
        root = next((i for i in instrs if i.is_root), None)
        written = None
        types = self.types.get(comp, {})
        if root is not None:
            parts = [root] if root.opcode != "tuple" else [next((i for i in instrs if i.name == o), None)
                                                           for o in root.operands]
            if parts and all(p is not None and p.opcode == "dynamic-update-slice" for p in parts):
                written = sum(hlo.shape_bytes(types.get(p.operands[1], "")) for p in parts if len(p.operands) > 1)
        return access, written

    def op_bytes(self, comp: str, ins: Instruction) -> int:
        if ins.opcode in FREE_OPCODES:
            return 0
        operands = self.operand_bytes(comp, ins)
        result = hlo.shape_bytes(ins.result)
        if ins.opcode == "dynamic-slice":
            return 2 * result
        if ins.opcode == "dynamic-update-slice":
            update = operands[1] if len(operands) > 1 else 0
            return 2 * update
        if ins.opcode == "fusion":
            callee = self.callee(ins, "calls")
            if callee:
                access, written = self._fusion_access(callee)
                operands = [access.get(i, b) for i, b in enumerate(operands)]
                if written is not None:
                    result = written
        return sum(operands) + result

    # --- collectives -------------------------------------------------------------------
    @_per_instance
    def _users(self, comp: str) -> dict[str, list[tuple[Instruction, int]]]:
        users: dict[str, list[tuple[Instruction, int]]] = {}
        for ins in self.comps.get(comp, []):
            for k, o in enumerate(ins.operands):
                users.setdefault(o, []).append((ins, k))
        return users

    @_per_instance
    def _params(self, comp: str) -> dict[int, str]:
        out = {}
        for ins in self.comps.get(comp, []):
            m = re.match(r"\s*(\d+)", ins.args) if ins.opcode == "parameter" else None
            if m:
                out[int(m.group(1))] = ins.name
        return out

    def _kept_fraction(self, comp: str, value: str, elements: int, depth: int = 0,
                       outer: tuple[str, str] | None = None) -> float | None:
        """The largest fraction of `value`'s elements any use keeps, following unary converts,
        bitcasts and copies (into and out of fusions), when every use ends in a dynamic-slice;
        else None. `outer` is (caller computation, fusion name) while inside a fusion."""
        uses = self._users(comp).get(value, [])
        if not uses and outer is not None and any(i.is_root and i.name == value for i in self.comps.get(comp, [])):
            return self._kept_fraction(outer[0], outer[1], elements, depth + 1)
        if not uses or depth > 8 or not elements:
            return None
        kept = 0.0
        for user, k in uses:
            if user.opcode == "dynamic-slice" and k == 0:
                out = hlo.shape_dims(user.result)
                f = math.prod(out[0][1]) / elements if out else None
            elif user.opcode in ("convert", "bitcast", "copy", "reshape"):
                f = self._kept_fraction(comp, user.name, elements, depth + 1, outer)
            elif user.opcode == "fusion" and self.callee(user, "calls") and outer is None:
                callee = self.callee(user, "calls")
                param = self._params(callee).get(k)
                f = self._kept_fraction(callee, param, elements, depth + 1, (comp, user.name)) if param else None
            else:
                f = None
            if f is None:
                return None
            kept = max(kept, f)
        return kept

    def _only_sliced(self, comp: str, value: str, shape_text: str, group: int) -> bool:
        """Every use of `value` keeps at most 1/group of it through a dynamic-slice."""
        dims = hlo.shape_dims(shape_text)
        if group <= 1 or not dims:
            return False
        kept = self._kept_fraction(comp, value, math.prod(dims[0][1]))
        return kept is not None and kept * group <= 1.001

    def _scattered_fraction(self, comp: str, ins: Instruction, group: int) -> float:
        elements = [hlo.shape_bytes(f"{d}[{','.join(map(str, s))}]") for d, s in hlo.shape_dims(ins.result)]
        total = sum(elements)
        if not total:
            return 0.0
        if not ins.result.lstrip().startswith("("):
            return 1.0 if self._only_sliced(comp, ins.name, ins.result, group) else 0.0
        scattered = 0
        for user, _ in self._users(comp).get(ins.name, []):
            m = re.search(r"index=(\d+)", user.attrs)
            if user.opcode == "get-tuple-element" and m and int(m.group(1)) < len(elements):
                if self._only_sliced(comp, user.name, user.result, group):
                    scattered += elements[int(m.group(1))]
        return scattered / total

    def _producer(self, comp: str, name: str) -> Instruction | None:
        return next((i for i in self.comps.get(comp, []) if i.name == name), None)

    def _widening_ratio(self, comp: str, operand: str) -> float:
        """< 1 when `operand` is a convert (or a fusion rooted in one, through bitcasts and
        copies) from a narrower type."""
        producer = self._producer(comp, operand)
        if producer is None:
            return 1.0
        where, root = comp, producer
        if producer.opcode == "fusion":
            callee = self.callee(producer, "calls")
            root = next((i for i in self.comps.get(callee, []) if i.is_root), None) if callee else None
            where = callee
        while root is not None and root.opcode in ("bitcast", "copy", "reshape") and root.operands:
            root = self._producer(where, root.operands[0])
        if root is None or root.opcode != "convert" or not root.operands:
            return 1.0
        src, dst = hlo.shape_dims(self.types[where].get(root.operands[0], "")), hlo.shape_dims(root.result)
        if not src or not dst:
            return 1.0
        return min(1.0, hlo.DTYPE_BYTES[src[0][0]] / hlo.DTYPE_BYTES[dst[0][0]])

    def collective(self, comp: str, ins: Instruction) -> CollectiveInfo | None:
        read = hlo.read_collective(ins, self.comps)
        if read is None:
            return None
        target, nbytes, groups, size = read.target, read.bytes, read.replica_groups, read.group_size
        operands = ins.operands  # an async-start's operands are its collective's
        ratios = [self._widening_ratio(comp, o) for o in operands]
        if len(ratios) == 1:
            narrow = int(nbytes * ratios[0])
        else:  # a combined collective: one result element per operand
            elements = [hlo.shape_bytes(f"{d}[{','.join(map(str, s))}]") for d, s in hlo.shape_dims(target.result)]
            if len(elements) == len(ratios) and sum(elements) > 0:
                narrow = int(nbytes * sum(e * r for e, r in zip(elements, ratios)) / sum(elements))
            else:
                narrow = nbytes
        scattered = self._scattered_fraction(comp, ins, size) if ins.opcode == "all-reduce" else 0.0
        return CollectiveInfo(read.kind, nbytes, narrow, groups, scattered)

    # --- ops ---------------------------------------------------------------------------
    def op(self, comp: str, position: int, ins: Instruction) -> Op:
        base = dict(name=ins.name, opcode=ins.opcode, computation=comp, position=position, operands=ins.operands)
        if ins.opcode in FREE_OPCODES:
            return Op(kind="free", **base)
        if ins.opcode in TRANSFER_OPCODES:
            return self._transfer(comp, ins, base)
        if ins.opcode.endswith("-done"):
            return Op(kind="collective-done", **base)
        info = self.collective(comp, ins)
        if info is not None:
            kind = "collective" if ins.opcode in hlo.COLLECTIVE_OPCODES else "collective-start"
            return Op(kind=kind, collective=info, **base)
        matmuls, dtype = self.matmuls(comp, ins)
        roundtrip = ins.opcode == "fusion" and self._is_roundtrip(self.callee(ins, "calls"))
        return Op(kind="compute", flops=float(sum(matmuls)), bytes=self.op_bytes(comp, ins), matmuls=matmuls,
                  dtype=dtype, widening_roundtrip=roundtrip, **base)

    def _transfer(self, comp: str, ins: Instruction, base: dict) -> Op:
        """copy-start (its bytes: the copied operand), send / recv (their bytes: the data array,
        first in their result (data, context, token); their groups: the source-target pairs), and
        their dones."""
        if ins.opcode == "copy-start":
            source = self.types[comp].get(ins.operands[0], "") if ins.operands else ""
            host = bool(_HOST_MEMORY.search(ins.result) or _HOST_MEMORY.search(source))
            return Op(kind="copy-start", bytes=hlo.shape_bytes(source), host_transfer=host, **base)
        if ins.opcode in ("send", "recv"):
            data = hlo.shape_dims(ins.result)[:1]
            nbytes = sum(hlo.DTYPE_BYTES[d] * math.prod(dims) for d, dims in data)
            info = CollectiveInfo(ins.opcode, nbytes, nbytes, hlo.parse_replica_groups(ins.attrs))
            return Op(kind=ins.opcode, collective=info, host_transfer="is_host_transfer=true" in ins.attrs, **base)
        return Op(kind=ins.opcode, **base)

    @_per_instance
    def _is_roundtrip(self, comp: str | None) -> bool:
        instrs = self.comps.get(comp or "", [])
        if not instrs or any(i.opcode not in ("parameter", "convert", "bitcast", "copy") for i in instrs):
            return False
        params = [hlo.shape_dims(i.result) for i in instrs if i.opcode == "parameter"]
        root = next((i for i in instrs if i.is_root), None)
        widths = [hlo.DTYPE_BYTES[d[0][0]] for i in instrs if i.opcode == "convert"
                  for d in [hlo.shape_dims(i.result)] if d]
        if len(params) != 1 or not params[0] or root is None or not hlo.shape_dims(root.result) or not widths:
            return False
        dtype = params[0][0][0]
        return hlo.shape_dims(root.result)[0][0] == dtype and min(widths) < hlo.DTYPE_BYTES[dtype]


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


def build_schedule(hlo_text: str, loop_trips: dict[str, int] | None = None,
                   custom_call_flops: dict[str, dict[str, float]] | None = None) -> Schedule:
    """The entry computation's ops in execution order (see the module docstring).
    `loop_trips`: trip counts of loops XLA cannot know, by the name scope they were traced under
    (segment-aware attention's pair loops: as many trips as the priced batch's block pairs).
    `custom_call_flops`: {name scope: {custom call target: FLOPs of one run}} for custom calls
    XLA counts no FLOPs for (cuDNN's fused attention, forward and backward)."""
    reader = HloReader(hlo_text)
    if reader.entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    templates: dict[str, list[Op]] = {}
    loops: list[dict] = []
    seen_loops: set[str] = set()

    def template(comp: str) -> list[Op]:
        if comp not in templates:
            templates[comp] = [reader.op(comp, i, ins) for i, ins in enumerate(reader.comps.get(comp, []))]
            for i, ins in enumerate(reader.comps.get(comp, [])) if custom_call_flops else ():
                given = _given_flops(ins, custom_call_flops)
                if given is not None:
                    templates[comp][i] = dataclasses.replace(templates[comp][i], flops=given, matmuls=(given,),
                                                             fused_attention=True)
        return templates[comp]

    def expand(comp: str, depth: int = 0) -> Iterator[Op]:
        if depth > 64:
            raise ValueError(f"computation nesting deeper than 64 at {comp}")
        for ins, op in zip(reader.comps.get(comp, []), template(comp)):
            if ins.opcode == "while":
                body = reader.callee(ins, "body")
                trips = hlo.trip_count(ins.attrs)
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
                    continue
                for _ in range(runs):
                    yield from expand(body, depth + 1)
            elif ins.opcode == "call":
                yield from expand(reader.callee(ins, "to_apply"), depth + 1)
            elif ins.opcode == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                branches = [b.strip().lstrip("%") for b in m.group(1).split(",")] if m else \
                    [c for c in (reader.callee(ins, "true_computation"), reader.callee(ins, "false_computation")) if c]
                if branches:
                    heaviest = max(branches, key=lambda b: sum(o.flops for o in template(b)))
                    yield from expand(heaviest, depth + 1)
            else:
                yield op

    ops = list(expand(reader.entry))
    return Schedule(ops=ops, entry=reader.entry, loops=loops, templates=templates)

"""What one instruction of a compiled module costs, read from XLA's HLO text: matmul FLOPs,
memory bytes, and a collective's bytes and groups. `xlaopt.analysis.schedule` orders these into
the step's ops; its docstring says how each figure is counted.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

from xlaopt.analysis import hlo
from xlaopt.analysis.hlo import Instruction

FREE_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id", "after-all",
    "add-dependency", "opt-barrier", "domain", "while", "call", "conditional",
})
_DOT_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# An f32 matmul at XLA's default precision runs on the tensor cores in TF32: jax 0.10.2's GPU
# compiler emits `mma...f32.tf32.tf32.f32` for it (checked in its PTX, tests/test_schedule.py).
# HIGHEST precision (or an f32 x f32 algorithm) asks for full f32.
_FULL_F32 = re.compile(r"operand_precision=\{highest|\"HIGHEST\"|algorithm=dot_f32_f32_f32|ALG_DOT_F32_F32_F32")


_KERNEL_STRATEGY = re.compile(r'"kernel_strategy":"KERNEL_STRATEGY_TRITON_(ONE_SHOT|TWO_SHOT)"')


def _tensor_core_type(element_type: str, attrs: str) -> str:
    """The operand type a matmul's tensor cores take: "tf32" for f32 at default precision."""
    return "tf32" if element_type == "f32" and not _FULL_F32.search(attrs) else element_type


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    kind: str  # one of hlo.COLLECTIVE_OPCODES (the `-start` suffix dropped)
    bytes: int  # per execution, scaling-book convention (see xlaopt.analysis.hlo)
    narrow_bytes: int  # the same with widening converts undone (see xlaopt.analysis.schedule)
    replica_groups: tuple[tuple[int, ...], ...]
    # All-reduce only: the fraction of its bytes whose every use keeps only this device's 1/n
    # slice (a dynamic-slice by partition): a reduce-scatter in all but name. XLA's CPU pipeline
    # leaves FSDP gradient reductions in this form; GPU pipelines rewrite them to reduce-scatter.
    scattered_fraction: float = 0.0
    # All-reduce on the GPU target: "one-shot" or "two-shot" where XLA annotated it for its own
    # kernel (`costmodel.kernel_strategy`), which runs instead of NCCL only under
    # `costmodel.ALL_REDUCE_KERNELS_OPTION`; "" otherwise.
    kernel: str = ""

    @property
    def group_size(self) -> int:
        return len(self.replica_groups[0]) if self.replica_groups else 1


def _scratch_bytes(ins: Instruction) -> int:
    """A library call's scratch buffer, the last element of its result tuple as a flat u8/s8 array
    (jax 0.10.2's GPU compile gives every cuBLAS GEMM an s8[4194304] one and cuDNN's attention a
    u8 one): not data the call reads or writes back. Counted, it priced a small GEMM by its 4 MiB of
    workspace, not its operands."""
    if ins.opcode != "custom-call":
        return 0
    shapes = hlo.shape_dims(ins.result)
    if len(shapes) > 1 and shapes[-1][0] in ("u8", "s8") and len(shapes[-1][1]) == 1:
        return shapes[-1][1][0]
    return 0


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
        return 2.0 * math.prod(out[0][1]) * contracting, _tensor_core_type(lhs[0][0], ins.attrs)

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
        return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims), _tensor_core_type(lhs[0][0], ins.attrs)

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
        dynamic-update-slice counts 0, or its slices where the fusion reads it through them too),
        and the bytes written when the root updates in place."""
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

        root = next((i for i in instrs if i.is_root), None)
        parts = [] if root is None else [root] if root.opcode != "tuple" else [
            next((i for i in instrs if i.name == o), None) for o in root.operands]
        in_place = {p.name for p in parts if p is not None and p.opcode == "dynamic-update-slice"}
        def sliced(name: str) -> int | None:
            # Bytes of `name`'s buffer the fusion reads where it reads it through slices alone
            # (None: read whole). The buffer an in-place update writes into is not read, also
            # where the fusion slices the same buffer (XLA's in-place `d[i] += g`, what a
            # scatter-add of one index becomes: the slice read, added and written back). An update
            # that is not the fusion's result is read as it is read on: through slices (a slice
            # of the updated buffer, 1F1B's stage inputs), or whole (R11's gradient stack, its
            # last layer's slice written in and the stack added to the accumulator).
            uses, total = through_bitcasts(name), 0
            for u, k in uses:
                part = (None if k != 0 else hlo.shape_bytes(u.result) if u.opcode == "dynamic-slice"
                        else 0 if u.name in in_place else sliced(u.name) if u.opcode == "dynamic-update-slice"
                        else None)
                if part is None:
                    return None
                total += part
            return total if uses else None

        access: dict[int, int] = {}
        for name, idx in params.items():
            touched = sliced(name)
            if touched is not None:
                access[idx] = touched
        written = None
        types = self.types.get(comp, {})
        if root is not None:
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
        return sum(operands) + result - _scratch_bytes(ins)

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
        kernel = _KERNEL_STRATEGY.search(ins.attrs) if read.kind == "all-reduce" else None
        return CollectiveInfo(read.kind, nbytes, narrow, groups, scattered,
                              kernel.group(1).lower().replace("_", "-") if kernel else "")

    @_per_instance
    def is_roundtrip(self, comp: str | None) -> bool:
        """Whether fused computation `comp` only widens a value it first narrowed."""
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

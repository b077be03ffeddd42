"""The "compiled" method of `xlaopt calibrate`: build a published run's decoder at full size,
compile one training step on a mesh with the row's data / FSDP / tensor degrees, and price the
compiled HLO with the schedule simulator and the frozen efficiencies.

It goes the way `xlaopt analyze` does (abstract parameters, the mesh-layout pass, XLA's CPU
pipeline on one simulated CPU device per mesh device, `xlaopt.analysis.schedule` + `xlaopt.analysis.simulate` with
the CPU fix-ups), with these choices, each because the rows ran that way and xlaopt's decoder
compiled on CPU would not:

- One micro-batch is compiled (`micro_batch` sequences per data rank) and the step is
  `micro_batches` times that, plus the optimizer update once: frameworks gather FSDP weights and
  reduce gradients per micro-batch and update once per step. The update is told apart from the
  forward / backward by the JAX name stack in the HLO metadata (see `_per_step`).
- Attention is a fused (flash) kernel in every published run. The decoder's attention is plain
  XLA ops that write the seq x seq logits to memory several times per layer (and, without
  recomputation, keep them for the backward), which priced by the roofline is several times the
  kernel's time. With `attention="kernel"` (the default) the decoder is compiled with an
  attention of the same inputs and output and elementwise cost (the execution setting
  `attention="io_only"`, see `xlaopt.models.attention.attention_io_only`), and the kernel is priced by
  `costmodel.attention_time_s` on the causal FLOPs, exactly as the analytic model prices it
  (forward, 2.5x backward, again when the policy recomputes attention: `analytic.recompute_fractions`).
  `attention="xla"` compiles and prices the decoder's own attention.
- XLA's CPU pipeline runs bf16 elementwise work in f32, so the scan that stacks each layer's
  saved activations widens the whole stacked buffer to update one layer's slice (and the
  backward widens it to read one slice). Priced as written that is every layer's activations
  moved once per layer; a GPU compile updates in place. `_inplace_fixups` prices those fusions
  as the in-place slice update / read they are (a fix-up in the spirit of `simulate`'s
  `cpu_fixups`, which does not cover this case yet).

What the compiled step still cannot show (reported per row in `approximations`):
recomputation compiles as the row's named policy (`xlaopt.models.remat`: MaxText's by name,
TorchTitan's per-op as selective_op, Megatron's selective as selective_megatron, which keeps the
attention's output where Megatron reruns the core attention), and XLA's full remat leaves out the
MLP down projection; xlaopt's rule table has no sequence parallelism; XLA fuses elementwise ops, so eager
PyTorch's extra memory traffic is absent; a `dp` axis replicates optimizer state where Megatron
shards it. And what the CPU target adds: no async collectives, so all communication is exposed
(the analytic model overlaps FSDP and data-parallel traffic with compute; `comm_s` in the
breakdown is that cost); bf16 work widened to f32 (converts and layout copies around the CPU's
matmul kernels, `convert_copy_s`); and, with tensor parallelism, a backward that all-reduces the
q, k, v (and gate, up) input gradients one by one where the frameworks sum them and reduce once.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.analytic import recompute_fractions
from xlaopt.errors import UserError
from xlaopt.mesh import MAX_SIMULATED_DEVICES, MeshSpec

# Each `attention` choice of `compile_step` as the execution setting `attention` it compiles.
ATTENTION = {"kernel": "io_only", "xla": "dense"}
# The analytic model's recomputation kinds as xlaopt's named policies (the others are names already).
_REMAT = {"selective-op": "selective_op", "selective-megatron": "selective_megatron"}
# AdamW, the global-norm clip and the step counter run outside value_and_grad: their ops carry
# neither the forward's `jvp(` nor the backward's `transpose(` in their JAX name stack.
_GRAD_SCOPES = ("jvp(", "transpose(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_UNARY = ("convert", "bitcast", "copy", "reshape")
_MOVES = ("parameter", "convert", "copy", "transpose", "bitcast", "reshape")


def compile_blocker(priced) -> str:
    """Why `priced` (a `calibrate.Priced`) cannot be compiled; "" when it can. Checked before
    anything is traced: the layout, the device count, the precision."""
    run, layout = priced.run, priced.run.layout
    if layout.pp > 1:
        return (f"pipeline parallel (pp={layout.pp}): the CPU method compiles one micro-batch of an unstaged "
                f"layout; --target gpu compiles pipelines")
    if layout.cp > 1:
        return f"context parallel (cp={layout.cp}): xlaopt has no ring attention to build it with"
    if layout.num_devices > MAX_SIMULATED_DEVICES:
        return (f"{layout.num_devices} devices: the CPU target compiles on at most {MAX_SIMULATED_DEVICES} "
                f"simulated devices")
    if priced.software.fp8_linear:
        return (f"precision {run.precision!r}: the CPU target has no fp8 GEMMs (XLA:CPU computes fp8 dots "
                f"widened); --target gpu compiles them")
    if layout.micro_batches != int(layout.micro_batches):
        return f"{layout.micro_batches:g} micro-batches per step: not a whole number to repeat the compiled one by"
    return ""


def approximations(priced) -> list[str]:
    """What the compiled step of `priced` leaves out of how the row ran (see the module docstring)."""
    sw, layout = priced.software, priced.run.layout
    notes = []
    if sw.recompute == "selective-megatron":
        notes.append("recompute 'selective-megatron' compiled as the policy selective_megatron, which keeps the "
                     "attention's output where Megatron reruns the core attention; the kernel's recomputed forward "
                     "is priced with the kernel")
    if sw.recompute == "full":
        notes.append("full recompute compiled as XLA's remat, which skips the MLP down projection (the backward "
                     "needs only its input); the analytic model recomputes the whole forward")
    if layout.tp > 1 and sw.sequence_parallel:
        notes.append("no sequence parallelism: xlaopt's rules keep activations whole on every tensor rank, so "
                     "norms and residual adds run tp times over and the TP collectives are all-reduces; the "
                     "backward all-reduces the q, k, v and gate, up input gradients separately")
    if not sw.fused_elementwise:
        notes.append("eager elementwise kernels compiled fused by XLA")
    if layout.dp > 1 and sw.sharded_optimizer:
        notes.append(f"optimizer state replicated over dp={layout.dp} (the row shards it)")
    return notes


def decoder_config(run):
    """xlaopt's generic decoder with the row's shape; raises ConfigError when it cannot be."""
    from xlaopt.models.decoder import DecoderConfig

    s = run.shape
    return DecoderConfig(name=f"{run.model or 'decoder'} ({run.id})", vocab_size=s.vocab, d_model=s.d_model,
                         num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.kv_heads, mlp_dim=s.ffn,
                         mlp_activation=s.mlp, tie_embeddings=s.tied_embeddings)


def execution_for(recompute: str, attention: str):
    """The execution config a row compiles under: its recomputation and `attention` (a key of
    `ATTENTION`)."""
    from xlaopt.execution import ExecutionConfig

    return ExecutionConfig(remat=_REMAT.get(recompute, recompute), attention=ATTENTION[attention])


def mesh_for(layout) -> MeshSpec:
    return MeshSpec.of(data=max(layout.dp, 1), fsdp=max(layout.fsdp, 1), tensor=layout.tp)


@dataclasses.dataclass
class CompiledStep:
    """A row's compiled micro-batch, split into what repeats per micro-batch and what runs once
    per step, ready to price under any efficiencies (`price`)."""
    priced: object  # calibrate.Priced
    mesh: MeshSpec
    attention: str
    micro_batch_ops: list
    per_step_ops: list
    timings_s: dict
    approximations: list[str]
    # Ops that only convert, copy or transpose (XLA CPU's f32 widening and layout copies around its
    # matmul kernels, mostly): reported apart as `convert_copy_s`, still priced in the step.
    convert_copy: frozenset = frozenset()

    def attention_s(self, eff: cm.Efficiency) -> float:
        """One micro-batch's fused attention kernels on one device (0 when compiled as XLA ops)."""
        if self.attention == "xla":  # compiled as XLA ops, priced with the rest of the HLO
            return 0.0
        run, layout = self.priced.run, self.priced.run.layout
        flops = run.shape.attention_forward_flops(layout.micro_batch, layout.seq_len) / layout.tp
        _, r_att, _ = recompute_fractions(run.shape, self.priced.software.recompute)
        passes = 1 + 2.5 + r_att
        peak = self.priced.topology.device.peak_flops["bfloat16"]
        return run.shape.layers * passes * cm.attention_time_s(flops, peak, eff)

    def price(self, eff: cm.Efficiency = cm.FITTED) -> dict:
        """Seconds per optimizer step and their parts, on the row's topology."""
        from xlaopt.analysis.schedule import Schedule
        from xlaopt.analysis.simulate import compute_time_s, simulate

        topology = self.priced.topology
        eff = eff.attention_for(self.priced.software.attention_kernel, topology.device.name)
        sim = lambda ops: simulate(Schedule(ops, "", [], {}), topology, self.mesh.as_dict(), eff,
                                   matmul_dtype="bfloat16", cpu_fixups=True, keep_timeline=False)
        mb, once = sim(self.micro_batch_ops), sim(self.per_step_ops)
        m = int(self.priced.run.layout.micro_batches)
        attention = self.attention_s(eff)
        matmul_s = convert_copy_s = 0.0
        for op in self.micro_batch_ops:
            if op.kind == "compute" and (op.matmuls or (op.computation, op.name) in self.convert_copy):
                t = compute_time_s(op, topology, eff, "bfloat16", cpu_fixups=True)
                matmul_s += t if op.matmuls else 0.0
                convert_copy_s += 0.0 if op.matmuls else t
        # The CPU schedule is sequential (no async collectives), so the parts simply add.
        return dict(step_time_s=m * (mb.step_time_s + attention) + once.step_time_s, micro_batches=m,
                    micro_batch_s=mb.step_time_s + attention, matmul_s=m * matmul_s,
                    memory_bound_s=m * (mb.compute_s - matmul_s), convert_copy_s=m * convert_copy_s,
                    attention_kernel_s=m * attention, comm_s=m * mb.comm_s,
                    comm_by_axis={axes: m * c["time_s"] for axes, c in mb.comm_by_axis.items()},
                    per_step_s=once.step_time_s)


def compile_step(priced, attention: str = "kernel") -> CompiledStep | str:
    """Compile `priced`'s row (see the module docstring); a string says why it cannot be."""
    import jax

    from xlaopt.analysis.analyze import check_fits
    from xlaopt.analysis.hlo_costs import HloReader
    from xlaopt.analysis.schedule import build_schedule
    from xlaopt.compile import compile_program
    from xlaopt.data.batch import BatchShape
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.program import TrainProgram, TrainSettings

    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}; use one of {', '.join(ATTENTION)}")
    why = compile_blocker(priced)
    if why:
        return why
    run, layout = priced.run, priced.run.layout
    mesh = mesh_for(layout)
    have = len(jax.devices())
    if mesh.num_devices > have:
        return (f"needs {mesh.num_devices} simulated CPU devices, this process has {have} (JAX started before "
                f"calibrate could ask for more)")
    try:
        config = decoder_config(run)
        batch = BatchShape(layout.micro_batch * layout.data, layout.seq_len, 0)
        program = TrainProgram(config, mesh, settings=TrainSettings(batch=batch),
                               execution=execution_for(priced.software.recompute, attention))
        check_fits(program, priced.topology)
        t0 = time.perf_counter()
        program, _ = run_pipeline(program, pipeline())
        compiled = compile_program(program)
        compiled.lowered  # noqa: B018 (timed apart from compilation)
        t1 = time.perf_counter()
        text = compiled.train_step.as_text()
    except UserError as e:  # the shape or a sharded dimension does not fit the decoder or the mesh
        return f"cannot build the decoder on mesh {mesh}: {e}"
    t2 = time.perf_counter()
    schedule = build_schedule(text)
    reader = HloReader(text)
    ops, convert_copy = _inplace_fixups(reader, schedule.ops)
    once = _per_step(reader)
    timings = dict(lower=t1 - t0, compile=t2 - t1, schedule=time.perf_counter() - t2)
    return CompiledStep(priced, mesh, attention, [o for o in ops if (o.computation, o.name) not in once],
                        [o for o in ops if (o.computation, o.name) in once], timings, approximations(priced),
                        frozenset(convert_copy))


def _per_step(reader) -> set[tuple[str, str]]:
    """(computation, name) of the entry computation's instructions outside value_and_grad: the
    optimizer update. Instructions whose metadata is not a JAX name stack (none, an XLA-made name
    such as the zeroing of a scan's buffers, a parameter's path) count as per micro-batch."""
    once = set()
    for ins in reader.comps.get(reader.entry, []):
        m = _OP_NAME.search(ins.attrs)
        if m and m.group(1).startswith("jit(") and not any(s in m.group(1) for s in _GRAD_SCOPES):
            once.add((reader.entry, ins.name))
    return once


def _inplace_fixups(reader, ops: list) -> tuple[list, set]:
    """`ops` with the bytes of fusions that widen a whole buffer to update or read one slice of it
    (XLA CPU's bf16 normalisation) priced as the in-place update / slice read a GPU runs; and the
    (computation, name) of ops that only convert, copy or transpose."""
    fixed: dict[tuple[str, str], int] = {}
    convert_copy = set()
    for comp, instrs in reader.comps.items():
        for ins in instrs:
            if ins.opcode in _MOVES[1:]:
                convert_copy.add((comp, ins.name))
            if ins.opcode != "fusion":
                continue
            callee = reader.comps.get(reader.callee(ins, "calls") or "", [])
            if callee and all(i.opcode in _MOVES for i in callee):
                convert_copy.add((comp, ins.name))
            nbytes = _inplace_bytes(reader, comp, ins)
            if nbytes is not None:
                fixed[(comp, ins.name)] = nbytes
    ops = [dataclasses.replace(o, bytes=fixed[(o.computation, o.name)]) if (o.computation, o.name) in fixed
           else o for o in ops]
    return ops, convert_copy


def _inplace_bytes(reader, comp: str, fusion) -> int | None:
    """Operand + result bytes of `fusion` with widened buffers counted in place; None when no
    parameter reaches a dynamic-(update-)slice through a convert."""
    from xlaopt.analysis import hlo

    callee = reader.callee(fusion, "calls")
    instrs = reader.comps.get(callee or "", [])
    if not instrs:
        return None
    by_name = {i.name: i for i in instrs}
    users: dict[str, list] = {}
    for i in instrs:
        for k, o in enumerate(i.operands):
            users.setdefault(o, []).append((i, k))
    first = lambda shape_text: next(iter(hlo.shape_dims(shape_text)), None)
    elements = lambda shape_text: math.prod(first(shape_text)[1]) if first(shape_text) else 0
    width = lambda shape_text: hlo.DTYPE_BYTES[first(shape_text)[0]] if first(shape_text) else 0

    def ends(value: str, hops: int = 0):
        """The uses `value` reaches through unary ops: [(user, operand index, converts passed)]."""
        out = []
        for user, k in users.get(value, []):
            if user.opcode in _UNARY:
                out += ends(user.name, hops + (user.opcode == "convert"))
            else:
                out.append((user, k, hops))
        return out

    widened = False
    operand_bytes = reader.operand_bytes(comp, fusion)
    params = {}
    for i in instrs:
        m = re.match(r"\s*(\d+)", i.args) if i.opcode == "parameter" else None
        if m:
            params[i.name] = int(m.group(1))
    buffers = set()
    access = list(operand_bytes)
    for name, idx in params.items():
        uses = ends(name)
        if idx >= len(access) or not uses:
            continue
        if all(u.opcode == "dynamic-update-slice" and k == 0 for u, k, _ in uses):
            access[idx], buffers = 0, buffers | {u.name for u, _, _ in uses}
            widened |= any(h for _, _, h in uses)
        elif all(u.opcode == "dynamic-slice" and k == 0 for u, k, _ in uses):
            access[idx] = sum(elements(u.result) for u, _, _ in uses) * width(by_name[name].result)
            widened |= any(h for _, _, h in uses)
    if not widened:
        return None
    root = next((i for i in instrs if i.is_root), None)
    if root is None:
        return None
    parts = [root] if root.opcode != "tuple" else [by_name.get(o) for o in root.operands]
    written = 0
    for part in parts:
        at = part
        while at is not None and at.opcode in _UNARY and at.operands:
            at = by_name.get(at.operands[0])
        if at is not None and at.name in buffers and len(at.operands) > 1:
            written += elements(reader.types[callee].get(at.operands[1], "")) * width(part.result)
        elif part is not None:
            written += hlo.shape_bytes(part.result)
    return sum(access) + written

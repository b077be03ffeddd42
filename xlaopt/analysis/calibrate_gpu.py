"""The compiled method of `xlaopt calibrate` on the GPU target: each published run's training
step at full size, compiled deviceless for the row's GPUs and priced from XLA's GPU schedule by
the simulator, as `xlaopt analyze --target gpu` prices a step.

What the judge of the passes is held to: the same compile (XLA's GPU pipeline, async collectives
under the latency-hiding scheduler, cuDNN's fused attention, the pipeline's passes with the
overlap-flags pass setting MaxText's XLA flags) and the same simulator, on a run someone measured.
A row a JAX framework ran compiles as its script compiled it (`frameworks.COMPILED_AS`): MaxText's
R01 with its XLA flags, XLA's memory-pressure rematerialization off among them, and its layers
unrolled. With that pass on, XLA recomputed three GEMMs a layer of R01 to fit a peak it put under
its limit (1.80 s a step priced; 1.56 s as MaxText compiled it, against 1.45 s measured; jax 0.10.2).
Unlike the CPU target's method (`calibrate_compiled`), nothing is compiled in parts or fixed up:
the whole step is compiled, its micro-batches (the row's `micro_batch` sequences per data rank,
as many as the global batch needs) and the optimizer update, on a mesh of the row's data, FSDP
and tensor degrees with the tensor ranks innermost (the frameworks' order), with the row's
recomputation as its named policy, its sequence parallelism as the rule table's, and its
data-parallel gradients crossing data in bf16 where its framework reduced them so (Megatron-Core's
default; `grad_reduce_dtype`, where xlaopt reduces them itself, said among the approximations
where it cannot) and summed over the micro-batches in bf16 there too (`grad_accumulate_dtype`:
Megatron-Core's grad buffer, which its GEMMs accumulate into, has the dtype it reduces in); Megatron's and NeMo's rows with their vocabulary padded as those frameworks pad it
(`vocab_as_run`). cuDNN's fused
attention calls, which XLA's cost analysis gives no FLOPs, are given those of rows holding one
document each, causal across the row, as the frameworks train by default and the analytic model
prices (`priced_batch.whole_rows_batch`).

A row the GPU target cannot build says why and is priced analytically (`calibrate`): context
parallel whose heads Ulysses cannot split, a GPU without a target config, an A100 (cuDNN's packed
attention needs Hopper). Pipeline stages that cannot hold equal layer counts compile with the
layers padded to a multiple of the stages (`stage_layers`), said among the approximations. A pipelined row
compiles as xlaopt's SPMD 1F1B loop (the row's 1F1B, or with virtual stages its interleaved 1F1B; the
ticks in lockstep), context parallel as Ulysses on
cuDNN; each says how that differs from the row's own schedule among its approximations. An fp8 row compiles with `matmuls="fp8"` (`xlaopt.models.fp8`: every
projection an fp8 GEMM), whatever scaling recipe the row used.
Every row compiles with the recomputation its source states and no other (`AS_THE_ROW_RAN`: XLA's
memory-pressure rematerialization, its HLO pass `rematerialization`, off, and the latency-hiding
scheduler's memory limit raised past the step's peak), as MaxText's GPU scripts compile theirs.
XLA's recomputation there is GEMMs cloned to squeeze a step that keeps more than the row's
framework did (xlaopt's optimizer keeps fp32 weights on every data rank, and a gradient buffer per
micro-batch beside the accumulator). On Llama 3 8B's R11 (150.8 GiB a device of 74.5) XLA cloned
MLP GEMMs up to three times in each layer (`*.remat`, `.remat2`, `.remat4`: 4.1 s of a 20.2 s
step; raising `xla_gpu_memory_limit_slop_factor` to 400 left them all); with the pass off, 18.0 s
(jax 0.10.2, 2026-12-06). Short of memory, the scheduler also stops overlapping collectives with
compute, which the row's framework, within its HBM, did. Until 2026-12-07 only a step over its HBM
even after that recomputation compiled so, and a step that fit kept XLA's clones: a row's price
then jumped with a few GiB of buffers either side of the HBM (R14 fit at 63.3 GiB with 0.9 s of
cloned GEMMs, and was priced without them at 75.5; N08 on B200 the same at 167.4 and 170.6 GiB).
A step over HBM says so among the row's approximations, priced all the same (the simulator does
not see memory); the planner drops such steps before pricing them. The schedule is kept, so a row is re-priced
under other efficiencies (the leave-one-out refits) without compiling again.
"""
from __future__ import annotations

import dataclasses
import time

from xlaopt.analysis import costmodel as cm
from xlaopt.errors import UserError
from xlaopt.mesh import DEVICE_ORDER_TENSOR_INNER, MeshSpec
from xlaopt.transforms.ulysses_attention import ulysses_split

# The compile option that turns XLA's memory-pressure rematerialization off (the module docstring);
# JAX's `jax_enable_remat_opt_pass=False` sets it too.
NO_MEMORY_REMAT = {"xla_disable_hlo_passes": "rematerialization"}
# Every row's step compiled with the row's own recomputation alone: without that pass, and with the
# latency-hiding scheduler's memory limit (the device's memory times this factor / 100; XLA's
# default 95) past any step's peak. Short of memory, the scheduler stops overlapping collectives
# with compute: R13's stage sends and tensor collectives ran with nothing between their start and
# done (18.8 s; 16.9 s with the limit raised, jax 0.10.2).
AS_THE_ROW_RAN = {**NO_MEMORY_REMAT, "xla_gpu_memory_limit_slop_factor": 100_000}


def gpu_blocker(priced) -> str:
    """Why `priced` (a `calibrate.Priced`) cannot be compiled for its GPUs; "" when it can."""
    from xlaopt.analysis import gpu_aot

    layout = priced.run.layout
    if not gpu_aot.available():
        return "the GPU target needs xlaopt[gpu-aot] (jax-cuda12-plugin)"
    shape = priced.run.shape
    if layout.micro_batches != int(layout.micro_batches):
        return f"{layout.micro_batches:g} micro-batches per step: not a whole number"
    if layout.pp > 1 and layout.micro_batches % layout.pp:
        return (f"pipeline parallel (pp={layout.pp}): {layout.micro_batches:g} micro-batches are not a multiple of "
                f"the stages")
    if layout.cp > 1 and ulysses_split(shape.heads, shape.kv_heads, layout.tp, layout.cp) is None:
        return (f"context parallel (cp={layout.cp}): Ulysses cannot split {shape.heads // layout.tp} query heads a "
                f"tensor rank over it")
    try:
        key = gpu_aot.device_key(priced.topology)
    except UserError as e:
        return str(e)
    if key == "a100":
        return ("cuDNN's fused attention over packed rows needs Hopper on jax 0.10.2 ('Packed layout requires a "
                "GPU with at least Hopper architecture'), and no other fused attention is built for A100")
    return ""


def mesh_for(layout) -> MeshSpec:
    return MeshSpec.of(DEVICE_ORDER_TENSOR_INNER, stage=layout.pp, data=max(layout.dp, 1), fsdp=max(layout.fsdp, 1),
                       tensor=layout.tp, context=layout.cp)


def stage_layers(run) -> int:
    """The layers a row compiles with: its own, or, where its pipeline's stages cannot hold equal
    counts (Llama 3 405B's 126 over 8), the next multiple of the stages. xlaopt builds equal stages
    only. A pipeline's tick lasts as long as its longest stage, which an uneven cut (Megatron's puts
    fewer layers on the stages holding the embedding or the loss) shares with this one; what the pad
    adds is its layers' compute. With virtual stages, a multiple of stages x virtual stages."""
    layers, pp = run.shape.layers, run.layout.pp
    chunks = pp * run.layout.virtual_stages
    return -(-layers // chunks) * chunks if pp > 1 else layers


# Megatron-LM and NeMo (and Megatron-Bridge) pad the vocabulary to a multiple of this many rows per
# tensor rank (`make_vocab_size_divisible_by`, default 128): GPT-3's 50,257 train as 50,688 on 4.
_MEGATRON_VOCAB_MULTIPLE = 128


def vocab_as_run(run) -> int:
    """The vocabulary the row's framework trained: Megatron's padded to a multiple of 128 x its
    tensor ranks; the others' as the model has it."""
    if not any(name in run.framework.lower() for name in ("megatron", "nemo")):
        return run.shape.vocab
    multiple = _MEGATRON_VOCAB_MULTIPLE * run.layout.tp
    return -(-run.shape.vocab // multiple) * multiple


def approximations(priced) -> list[str]:
    """What the compiled step leaves out of how the row ran."""
    sw, layout = priced.software, priced.run.layout
    notes = []
    layers, built = priced.run.shape.layers, stage_layers(priced.run)
    if built != layers:
        notes.append(f"{layers} layers compiled as {built} ({built // layout.pp} on each of {layout.pp} equal "
                     f"stages, the only kind xlaopt builds; the row's framework cut them unevenly): the "
                     f"{built - layers} extra layer{'s' * (built - layers > 1)} priced, "
                     f"{(built - layers) / layers:.1%} more layer compute")
    if not sw.fused_elementwise:
        notes.append("eager elementwise kernels compiled fused by XLA")
    if sw.fp8_linear and "current" not in priced.run.precision.lower():
        notes.append(f"fp8 with per-tensor current scaling (the row's: {priced.run.precision})")
    if layout.pp > 1 and layout.virtual_stages > 1:
        v, m = layout.virtual_stages, layout.micro_batches
        notes.append(f"pipeline compiled as xlaopt's SPMD interleaved 1F1B loop over {v} virtual stages (the row's "
                     f"schedule, its forward and backward ticks in lockstep): the bubble is {layout.pp - 1} of "
                     f"{v} x {m:g} + {layout.pp - 1} ticks of 1/{v} of a stage's layers, at most "
                     f"{min(int(v * m), 2 * v * layout.pp - 1)} such ticks' activations held, the embedding on "
                     f"every stage")
    elif layout.pp > 1:
        m = layout.micro_batches
        notes.append(f"pipeline compiled as xlaopt's SPMD 1F1B loop (the row's schedule, its forward and backward "
                     f"ticks in lockstep): the bubble is {layout.pp - 1} of {m:g} + {layout.pp - 1} stage times, at "
                     f"most {min(int(m), 2 * layout.pp - 1)} micro-batches' activations held, the embedding on "
                     f"every stage")
    if layout.cp > 1:
        notes.append("context parallel compiled as Ulysses' all-to-alls around cuDNN on whole rows (the row's "
                     "framework passes K and V round a ring)")
    if sw.tp_overlap and layout.tp > 1:
        notes.append("the framework overlaps tensor-parallel communication with its matmuls; XLA's schedule "
                     "overlaps what its latency-hiding scheduler finds")
    return notes


@dataclasses.dataclass
class GpuStep:
    """A row's step compiled for its GPUs: the schedule, priced under any efficiencies."""
    priced: object  # calibrate.Priced
    mesh: MeshSpec
    schedule: object  # xlaopt.analysis.schedule.Schedule
    timings_s: dict
    approximations: list[str]
    attention: str = "cudnn"

    def price(self, eff: cm.Efficiency = cm.FITTED) -> dict:
        """Seconds per optimizer step and their parts, on the row's topology."""
        from xlaopt.analysis.simulate import simulate

        topology = self.priced.topology
        eff = eff.attention_for(self.priced.software.attention_kernel, topology.device.name)
        sim = simulate(self.schedule, topology.placed(self.mesh.placement()), self.mesh.as_dict(), eff=eff,
                       keep_timeline=False)
        return dict(step_time_s=sim.step_time_s, compute_s=sim.compute_s, comm_s=sim.comm_s,
                    exposed_comm_s=sim.exposed_comm_s,
                    comm_by_axis={axes: c["time_s"] for axes, c in sim.comm_by_axis.items()})


def compile_gpu_step(priced) -> GpuStep | str:
    """Compile `priced`'s row for its GPUs (see the module docstring); a string says why not."""
    from xlaopt.analysis.analyze import branches_taken, check_fits, compiled_for, memory_of
    from xlaopt.analysis.attention_work import batch_work
    from xlaopt.analysis.calibrate_compiled import decoder_config, execution_for
    from xlaopt.analysis.frameworks import compiled_as
    from xlaopt.analysis.priced_batch import whole_rows_batch
    from xlaopt.analysis.schedule import build_schedule
    from xlaopt.context import PassContext
    from xlaopt.data.batch import BatchShape
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.program import TrainProgram, TrainSettings
    from xlaopt.sharding import DEFAULT_RULES, with_sequence_parallel
    from xlaopt.transforms.compiler_options import CompilerOptions

    why = gpu_blocker(priced)
    if why:
        return why
    run, layout, sw = priced.run, priced.run.layout, priced.software
    mesh = mesh_for(layout)
    rules = with_sequence_parallel(DEFAULT_RULES) if sw.sequence_parallel and layout.tp > 1 else DEFAULT_RULES
    execution = dataclasses.replace(execution_for(sw.recompute, "kernel"), attention="cudnn",
                                    micro_batches=int(layout.micro_batches),
                                    matmuls="fp8" if sw.fp8_linear else "compute",
                                    sharded_optimizer=sw.sharded_optimizer and layout.dp > 1)
    if layout.pp > 1:  # the row's micro-batches run through the stages in one accumulation step
        execution = dataclasses.replace(execution, layer_stack="pipeline", micro_batches=1,
                                        pipeline_microbatches=int(layout.micro_batches),
                                        pipeline_virtual_stages=layout.virtual_stages,
                                        pipeline_schedule="1f1b")
    flags, unrolled = compiled_as(run)  # a JAX framework's own flags, which the overlap-flags pass leaves
    if unrolled and execution.layer_stack == "scan":
        execution = dataclasses.replace(execution, layer_stack="unrolled")
    try:
        config = dataclasses.replace(decoder_config(run), num_layers=stage_layers(run), vocab_size=vocab_as_run(run))
        program = TrainProgram(config, mesh, rules=rules, target="gpu", execution=execution,
                               settings=TrainSettings(batch=BatchShape(layout.global_batch, layout.seq_len, 0)),
                               compiler_options=CompilerOptions(flags))
        check_fits(program, priced.topology)
        t0 = time.perf_counter()
        program, _ = run_pipeline(program, pipeline(), ctx=PassContext.for_program(program, priced.topology))
        program, why_fp32 = _reduced_as_the_row(program, sw)
        program = program.replace(compiler_options=program.compiler_options.merged(AS_THE_ROW_RAN))
        compiled, lower_s, compile_s = compiled_for(program, priced.topology, "gpu")
        peak, hbm = memory_of(compiled.train_step)["peak_estimate"], priced.topology.device.hbm_bytes
        text = compiled.train_step.as_text()
    except UserError as e:  # the shape or a sharded dimension does not fit the decoder or the mesh
        return f"cannot build the decoder on mesh {mesh}: {e}"
    t1 = time.perf_counter()
    # cuDNN's fused attention calls carry no FLOPs in XLA's cost analysis: given by name scope,
    # for rows of one document each (causal across the row, as the frameworks ran them).
    work = batch_work(program, whole_rows_batch(program).arrays)
    schedule = build_schedule(text, custom_call_flops=work.custom_call_flops, branch_taken=branches_taken(program))
    notes = approximations(priced) + ([why_fp32] if why_fp32 else [])
    if 0 < hbm < peak:  # priced all the same: the simulator does not see memory
        notes.append(f"the compiled step needs {peak / 2**30:,.1f} GiB per device of {hbm / 2**30:,.1f}: it keeps "
                     f"more than the row's framework did (priced all the same)")
    return GpuStep(priced, mesh, schedule, dict(lower=lower_s, compile=compile_s, passes=t1 - t0 - lower_s - compile_s,
                                                schedule=time.perf_counter() - t1), notes)


def _reduced_as_the_row(program, software):
    """`program` with its data-parallel gradients reduced in bfloat16 where the row's framework
    reduced them so (`Software.grad_reduce_bytes` 2: Megatron-Core's default) and xlaopt reduces
    them itself, and summed over the micro-batches in bfloat16 where xlaopt sums them (the
    framework's grad buffer); and, where it cannot reduce them so, what that leaves out ("" otherwise)."""
    from xlaopt.step import why_not_accumulated_by_xlaopt, why_not_reduced_by_xlaopt

    if software.grad_reduce_bytes != 2:
        return program, ""
    if not why_not_accumulated_by_xlaopt(program):
        program = program.replace(execution=dataclasses.replace(program.execution, grad_accumulate_dtype="bfloat16"))
    if program.mesh.size("data") == 1:
        return program, ""
    why = why_not_reduced_by_xlaopt(program)
    if why:
        return program, f"data-parallel gradients reduced in float32 where the row's framework reduced them in bf16: {why}"
    return program.replace(execution=dataclasses.replace(program.execution, grad_reduce_dtype="bfloat16")), ""


def compile_rows(priced: list, log=None) -> dict:
    """Row id -> its `GpuStep`, or why it was not compiled for its GPUs (`priced`: `calibrate.Priced`)."""
    steps = {}
    for p in priced:
        why = gpu_blocker(p)
        if not why and log is not None:
            log(f"compiling {p.run.id} ({p.run.model}, mesh {mesh_for(p.run.layout)}, {p.topology.name}) ...")
        steps[p.run.id] = why or compile_gpu_step(p)
    return steps

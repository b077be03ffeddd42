"""overlap-flags: XLA's own GPU overlap machinery switched on by compiler options, MaxText's way.

"Flags only" as a pass, so it can be compared with the structural overlap passes and combined
with them. On the GPU target it sets:
  xla_gpu_enable_latency_hiding_scheduler        schedule async collectives early, done late;
  xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}
                                                 the collective pipeliner: move a loop's per-layer
                                                 collectives into the previous / next iteration;
  xla_gpu_enable_while_loop_double_buffering     unroll the layer loop by two so they can (off by
                                                 default, see below);
  xla_gpu_enable_highest_priority_async_stream   collectives on a high-priority stream;
  xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes
                                                 sized from the topology (below).
Checked on jax 0.10.2 in the compiler's own pass dumps (tests/test_overlap_flags.py): without
these options the collective pipeliner and the loop double-buffer transformer change nothing;
with them both rewrite the step (the pipeliner is linked into these wheels, whatever reports
against 0.10.x said). Windowed einsum is left out: it is tensor parallel's, and multi-stream
windowed einsum fails the HLO verifier for large shards on 0.10.2 (jax#39200).

Combine threshold: combined collectives should be large enough that the per-step latency of
the slowest ring is a tenth of its transfer time or less: 10 x (ranks - 1) x latency x
bandwidth, for a ring over the nodes on the network level (or over one node's devices on NVLink
when there is one node). Without a topology XLA's defaults stay.

Options the program already holds (`--xla-option`) are the user's and win; the report lists
what was set and what was left.

The pipelined all-gather is left off where the step loops over micro-batches (outside a pipeline)
and the partitioner splits a row's sequence (over context, or over tensor by sequence
parallelism; not a decoder's context, over which the loop runs manual). There the
micro-batch loop's body gathers activations that its layer loops produce (the head's input, the
backward's), and XLA's backward pipeliner, which on the GPU accepts any operand chain, moves each
gather a micro-batch early together with the forward and backward layer loops that feed it:
every micro-batch's layers then run twice, the original loops for the gradients and the clones for
the gathers. Seen in jax 0.10.2's own pass dumps and the compiled program's loops (llama3-8b, 4
layers, 4 micro-batches on `data=4,context=2` or `data=4,tensor=2` with sequence parallelism:
33.0 TFLOP a device against 17.6, and 17.6 with only this flag off; tests/test_overlap_flags.py).
The pipeline's tick loop and FSDP's gathers are not affected, and keep it.

Loop double buffering is off unless asked for (`overlap-flags.double_buffering=true`). On the
priced H100 schedule it gains 0.15% on cosmos3-nano's planned 720p step and costs 25-31% on
llama3-70b's (FSDP 128, 2 micro-batches: 29.2 s -> 36.6 s on 2026-12-05), where the schedule holds
18% more matmul FLOPs. That work is real, read from the compiled program: each unrolled body holds
two layers' activations, and XLA's memory-pressure rematerialization then recomputes the MLP's
up-projections, whole GEMMs (`*.double_buffer_clone.remat`, `.remat2` in the loop bodies).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.context import Pass, PassContext, PassResult
from xlaopt.program import TrainProgram

_SCHEDULING = ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_highest_priority_async_stream")
_PIPELINED = tuple(f"xla_gpu_enable_pipelined_{kind}" for kind in ("all_gather", "reduce_scatter", "all_reduce"))
_DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"
_COMBINE = tuple(f"xla_gpu_{kind}_combine_threshold_bytes" for kind in ("all_reduce", "all_gather", "reduce_scatter"))
_PIPELINED_ALL_GATHER = _PIPELINED[0]
LATENCY_SHARE = 0.1  # of a combined collective's transfer time, at most


def combine_threshold_bytes(topology) -> int:
    """Bytes at which the slowest ring's latency is `LATENCY_SHARE` of its transfer time."""
    level = topology.levels[-1] if topology.nodes > 1 else topology.levels[0]
    ranks = topology.nodes if topology.nodes > 1 else topology.devices_per_node
    return int(max(ranks - 1, 1) * level.latency_s * level.bytes_per_s / LATENCY_SHARE)


def clones_layer_loops(program: TrainProgram) -> str | None:
    """Why XLA's pipelined all-gather would run every micro-batch's layers twice (module
    docstring), or None where it would not."""
    from xlaopt.sharding import RESIDUAL_SEQ
    from xlaopt.step import manual_sequence_axis

    if program.execution.micro_batches == 1 or program.execution.layer_stack == "pipeline":
        return None
    # A loop manual over the axis (a decoder's context) runs each rank's chunk: nothing to gather.
    split = sorted({a for logical, axes in program.rules if logical in ("seq", RESIDUAL_SEQ)
                    for a in axes if program.mesh.size(a) > 1} - {manual_sequence_axis(program)})
    if not split:
        return None
    return (f"{program.execution.micro_batches} micro-batches with the sequence split over {', '.join(split)}: the "
            f"micro-batch loop gathers activations its layer loops make, and XLA's pipeliner would clone those "
            f"loops to gather a micro-batch early (every layer run twice)")


@dataclasses.dataclass(frozen=True)
class OverlapFlags(Pass):
    name: ClassVar[str] = "overlap-flags"
    summary: ClassVar[str] = ("XLA GPU overlap flags, MaxText's way: latency-hiding scheduler, pipelined collectives, "
                              "loop double buffering, combine thresholds sized from the topology (gpu target)")
    pipelined_collectives: bool = True
    double_buffering: bool = False  # see the module docstring
    combine_threshold_bytes: int = 0  # 0: sized from the topology (XLA's default without one)

    def why_not(self, program: TrainProgram, ctx: PassContext) -> str | None:
        if ctx.target != "gpu":
            return f"sets XLA GPU compiler flags; this program compiles for the {ctx.target} target (use --target gpu)"
        return None

    def options(self, ctx: PassContext, program: TrainProgram | None = None) -> dict:
        opts = dict.fromkeys(_SCHEDULING, True)
        if self.pipelined_collectives:
            opts.update(dict.fromkeys(_PIPELINED, True))
            if program is not None and clones_layer_loops(program):
                opts[_PIPELINED_ALL_GATHER] = False
        if self.double_buffering:
            opts[_DOUBLE_BUFFERING] = True
        threshold = self.combine_threshold_bytes or (combine_threshold_bytes(ctx.topology) if ctx.topology else 0)
        if threshold:
            opts.update(dict.fromkeys(_COMBINE, threshold))
        return opts

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        wanted = self.options(ctx, program)
        held = program.compiler_options
        set_now = {k: v for k, v in wanted.items() if k not in held}
        new = program.replace(compiler_options=held.merged(set_now))
        report = {"set": set_now, "left_to_the_user": {k: held[k] for k in wanted if k in held}}
        why = clones_layer_loops(program) if self.pipelined_collectives else None
        if why and _PIPELINED_ALL_GATHER in set_now:
            report["pipelined_all_gather_off"] = why
        return PassResult(new, new != program, report)

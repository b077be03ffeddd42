"""The work of the batch a price is for: how full its rows are, the attention pairs its mask
needs against those the step executes, and the trip counts of segment-aware attention's pair
loops on the busiest device (which XLA cannot know: they follow the batch).

A (query, key) pair is needed when the two-way mask lets a real query see a real key (padding
needs nothing). Executed pairs are those the attention implementation computes: every pair for
dense and blockwise attention, each listed block pair's block x block for segment-aware attention,
each segment's pairs (padding's included) for cuDNN's fused attention, whose custom calls XLA
counts no FLOPs for: the busiest device's are given to the schedule by name scope.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from xlaopt.families import family_of
from xlaopt.models.masks import Tokens
from xlaopt.program import TrainProgram


@dataclasses.dataclass(frozen=True)
class BatchWork:
    fill: float  # real tokens / slots
    model_flops: float  # one training step's model FLOPs (padding and masked pairs excluded)
    pairs_needed: float  # per layer, over the batch
    pairs_executed: float | None  # per layer, over the batch; None: the implementation computes none (io_only)
    loop_trips: dict[str, int]  # pair-loop name scope -> trips per run on the busiest device
    mean_loop_trips: dict[str, float]  # the same, averaged over the devices (what the cluster executes)
    # fused-attention name scope -> {custom call target: FLOPs per run on the busiest device}
    custom_call_flops: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    mean_custom_call_flops: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # the average's

    @property
    def pairs_executed_over_needed(self) -> float | None:
        if self.pairs_executed is None or not self.pairs_needed:
            return None
        return self.pairs_executed / self.pairs_needed


def needed_pairs(q: Tokens, k: Tokens) -> np.ndarray:
    """[B] (query, key) pairs the two-way mask allows between real tokens, per row: a generator
    query sees every key of its sample; a reasoner query its sample's reasoner keys up to itself."""
    q_seg, q_gen, q_idx = (np.asarray(a) for a in q)
    k_seg, k_gen, k_idx = (np.asarray(a) for a in k)
    B, S = k_seg.shape
    segments = int(max(q_seg.max(initial=0), k_seg.max(initial=0))) + 1
    rows = np.arange(B)[:, None]
    out = np.zeros(B, np.float64)
    # Generator queries: the keys of their segment.
    per_segment = np.zeros((B, segments), np.int64)
    np.add.at(per_segment, (np.broadcast_to(rows, k_seg.shape), k_seg), k_seg > 0)
    gen = q_gen & (q_seg > 0)
    out += np.where(gen, per_segment[rows, q_seg], 0).sum(axis=1)
    # Reasoner queries: reasoner keys of their segment at or before them, by a sorted (row, segment,
    # index) key: searchsorted counts each query's keys in one pass.
    span = S + 1
    key_of = lambda r, seg, idx: (r * segments + seg) * span + idx
    k_real = ~k_gen & (k_seg > 0)
    keys = np.sort(key_of(np.broadcast_to(rows, k_seg.shape), k_seg, k_idx)[k_real])
    q_real = ~q_gen & (q_seg > 0)
    r = np.broadcast_to(rows, q_seg.shape)[q_real]
    seen = (np.searchsorted(keys, key_of(r, q_seg[q_real], q_idx[q_real]), "right")
            - np.searchsorted(keys, key_of(r, q_seg[q_real], 0), "left"))
    np.add.at(out, r, seen)
    return out


def _per_device_trips(per_row: np.ndarray, program: TrainProgram) -> tuple[int, float]:
    """Trips per run of a pair loop on the device that does most, and on the average device: the
    rows of each micro-batch split contiguously over the batch's mesh axes (devices along the
    other axes repeat their shard's rows); averaged over micro-batches, as one count prices every
    run of the loop. Under a pipeline one run is one stage's pass over one of the pipeline's
    micro-batches, which the stack cuts from each row shard's rows (`models.pipeline.split`)."""
    from xlaopt.mesh import STAGE
    from xlaopt.sharding import batch_axes

    axes = batch_axes(program)
    ways = math.prod(program.mesh.size(a) for a in axes)
    per_micro = per_row.reshape(program.execution.micro_batches, -1)
    stages = program.mesh.size(STAGE)
    if program.execution.layer_stack == "pipeline" and stages > 1 and STAGE in axes:
        m = program.execution.pipeline_microbatches or stages
        # [micro, shard, stage s, part q, rows] -> runs (micro, s, q) x row shards
        cut = per_micro.reshape(per_micro.shape[0], ways // stages, stages, m // stages, -1).sum(axis=4)
        per_shard = np.moveaxis(cut, 1, 3).reshape(-1, ways // stages)
    else:
        per_shard = per_micro.reshape(per_micro.shape[0], ways, -1).sum(axis=2)
    return int(math.ceil(per_shard.max(axis=1).mean())), float(per_shard.mean())


def _heads_per_device(program: TrainProgram) -> int:
    """Query heads of one device's attention: the heads split over the mesh axes the layout gives
    the attention's heads (none before a layout)."""
    from xlaopt.sharding import mesh_axes_of

    heads = program.model.num_heads
    if program.shardings is None:
        return heads
    axes = mesh_axes_of("act_heads", heads, program.rules, program.mesh, "the attention heads")
    return heads // math.prod(program.mesh.size(a) for a in axes)


def _heads_per_call(program: TrainProgram) -> int:
    """Query heads one fused-attention call runs on a device: its share of the heads, and under
    Ulysses (whole rows, the heads split over the context ranks and cut into `chunks` groups,
    one call each) that share's part."""
    from xlaopt.transforms.ulysses_attention import UlyssesAttentionTransform

    heads = _heads_per_device(program)
    for t in program.grad_transforms:
        if isinstance(t, UlyssesAttentionTransform):
            heads //= program.mesh.size(t.axis) * t.chunks
    return heads


def _fused_flops(pairs: float, program: TrainProgram) -> dict[str, float]:
    """Forward and backward FLOPs of one run of a fused-attention call over `pairs` (query, key)
    pairs on one device: 4 H K per pair forward (Q K^T and P V), `BACKWARD_OVER_FORWARD` times that back."""
    from xlaopt.models.cudnn_attention import BACKWARD_OVER_FORWARD, BACKWARD_TARGET, FORWARD_TARGET

    forward = 4.0 * _heads_per_call(program) * program.model.head_dim * pairs
    return {FORWARD_TARGET: forward, BACKWARD_TARGET: BACKWARD_OVER_FORWARD * forward}


def batch_work(program: TrainProgram, batch: dict[str, np.ndarray]) -> BatchWork:
    """The work of `batch` (host arrays of the program's batch contract; the latents are not read)."""
    from xlaopt.models.cudnn_attention import check_rows, fused_tag, pairs_computed
    from xlaopt.models.segment_attention import loop_tag, pair_counts

    family = family_of(program.model)
    shape = program.settings.batch
    fill = family.real_tokens(batch) / shape.tokens
    impl, block = program.execution.attention, program.execution.attention_block
    needed = executed = 0.0
    trips: dict[str, int] = {}
    mean_trips: dict[str, float] = {}
    fused: dict[str, dict[str, float]] = {}
    mean_fused: dict[str, dict[str, float]] = {}
    calls = family.attention_calls(batch)
    if impl == "cudnn" and calls:
        check_rows({k: batch[k] for k in family.segment_keys}, program.execution.attention_max_segments)
    for q, k in calls:
        (B, L), S = q.segment_BL.shape, k.segment_BL.shape[1]
        needed += float(needed_pairs(q, k).sum())
        if impl == "segment":
            per_row = pair_counts(q, k, block)
            executed += float(per_row.sum()) * block * block
            trips[loop_tag(L, S)], mean_trips[loop_tag(L, S)] = _per_device_trips(per_row, program)
        elif impl == "cudnn":
            per_row = pairs_computed(q, k)
            executed += float(per_row.sum())
            busiest, mean = _per_device_trips(per_row, program)
            fused[fused_tag(L, S)], mean_fused[fused_tag(L, S)] = _fused_flops(busiest, program), _fused_flops(mean, program)
        else:
            executed += float(B * L * S)
    return BatchWork(fill, float(family.step_flops(program, batch)), needed,
                     None if impl == "io_only" else executed, trips, mean_trips, fused, mean_fused)

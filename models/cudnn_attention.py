"""JAX's fused cuDNN attention over packed rows: each sample attended as its own sequence.

cuDNN's flash attention (jax 0.10.2, Hopper and newer) takes rows packed with several
segments: per row, each segment's start and length in the queries and in the keys (at most
`max_segments` samples a row, a static size; unused entries -1). Within a segment it applies
a causal or a full mask and it never visits pairs across segments, so its work is the pairs
each sample needs. The three calls of the models map onto it as:
  reasoner over reasoner, decoder over itself (as many keys as queries): causal within each
      segment, the same starts for queries and keys (PADDING_CAUSAL);
  generator over [reasoner region | generator region] (more keys than queries): the keys are
      gathered so that each sample's keys are contiguous, [text_i | gen_i], then every query of
      gen_i sees all of its segment (PADDING). The gather is an ordinary take, so gradients flow
      back through it to both regions.
Padding (segment 0, after the samples in each region) is one more segment, last: in the causal
calls it is causal within itself and generator padding sees all padding, exactly as the dense
mask treats it, so every output is defined (no 0/0 leaks into the next layer or the gradients).

A row with more samples than `max_segments` cannot be expressed: `check_rows` refuses such a
batch on the host before the step runs (its segment ids are data, the budget is a shape).

Scope: a GPU-only implementation (`attention=cudnn` on the gpu target). Its numerics cannot be
checked on a machine without a GPU: what is tested on the CPU is everything around the cuDNN
call (the segment starts and lengths, the key order of the generator call; a pure-JAX
attention over the same segments matches dense attention) and that the step compiles
deviceless to the fused kernels. The jax-version-specific workarounds are in
`xlaopt.models.cudnn_jax_patches`.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from xlaopt.errors import UserError
from xlaopt.models.layers import batch_mesh_axes, head_axes_among
from xlaopt.models.masks import Tokens

MAX_SEGMENTS = 64  # samples a row may hold by default (`--exec attention_max_segments=...`)
FORWARD_TARGET, BACKWARD_TARGET = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
BACKWARD_OVER_FORWARD = 2.5  # backward matmuls per forward matmul: dQ, dK, dV, dP, and S recomputed


def fused_tag(L: int, S: int) -> str:
    """The name scope of the fused-attention calls of L queries over S keys: the analysis finds
    the custom calls by it and gives them the FLOPs of the batch it prices (XLA counts none)."""
    return f"xlaopt_fused_L{L}_S{S}"


class Segments(NamedTuple):
    """What cuDNN's packed layout reads, per row: [B, M] lengths, [B, M + 1] starts, -1 unused."""
    q_seqlen_BM: jax.Array
    kv_seqlen_BM: jax.Array
    q_offsets_BM1: jax.Array
    kv_offsets_BM1: jax.Array


def _slots(segment_BL, max_segments: int):
    """Sample s -> slot s - 1; padding -> the last slot (laid out after every sample)."""
    return jnp.where(segment_BL > 0, segment_BL - 1, max_segments)


def _counts(slot_BL, slots: int):
    return jax.vmap(lambda s: jnp.bincount(s, length=slots))(slot_BL).astype(jnp.int32)


def _starts(counts_BM):
    return jnp.cumsum(counts_BM, axis=1) - counts_BM


def _used(present_BM, values_BM, extra_column: bool = False):
    out = jnp.where(present_BM, values_BM, -1).astype(jnp.int32)
    return jnp.pad(out, ((0, 0), (0, 1)), constant_values=-1) if extra_column else out


def causal_segments(tokens: Tokens, max_segments: int) -> Segments:
    """Queries and keys the same tokens: one segment per sample (and padding), same starts."""
    slots = max_segments + 1
    n_BM = _counts(_slots(tokens.segment_BL, max_segments), slots)
    present = n_BM > 0
    offsets = _used(present, _starts(n_BM), extra_column=True)
    lengths = _used(present, n_BM)
    return Segments(lengths, lengths, offsets, offsets)


def generator_segments(q_tokens: Tokens, k_tokens: Tokens, max_segments: int) -> tuple[Segments, jax.Array]:
    """Generator queries over [text | generator] keys: the segments, and [B, S] the key order
    that makes each sample's keys [text_i | gen_i] (index into the keys as given)."""
    slots = max_segments + 1
    T = k_tokens.segment_BL.shape[1] - q_tokens.segment_BL.shape[1]
    k_slot_BS = _slots(k_tokens.segment_BL, max_segments)
    t_BM, v_BM = _counts(k_slot_BS[:, :T], slots), _counts(_slots(q_tokens.segment_BL, max_segments), slots)
    present = v_BM > 0  # a sample without generator tokens has no queries here
    # Keys by (slot, region), stable: each sample's text keys in order, then its generator keys.
    in_generator_BS = jnp.arange(k_slot_BS.shape[1]) >= T
    order_BS = jnp.argsort(2 * k_slot_BS + in_generator_BS, axis=1, stable=True).astype(jnp.int32)
    segments = Segments(_used(present, v_BM), _used(present, t_BM + v_BM),
                        _used(present, _starts(v_BM), extra_column=True),
                        _used(present, _starts(t_BM) + _starts(v_BM), extra_column=True))
    return segments, order_BS


def _fused(q_BLHK, k_BSNK, v_BSNK, segments: Segments, causal: bool):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from xlaopt.models import cudnn_jax_patches

    cudnn_jax_patches.install()
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    return fa.dot_product_attention(q_BLHK, k_BSNK, v_BSNK, q_seqlen=segments.q_seqlen_BM,
                                    kv_seqlen=segments.kv_seqlen_BM, q_offsets=segments.q_offsets_BM1,
                                    kv_offsets=segments.kv_offsets_BM1, scale=q_BLHK.shape[-1] ** -0.5,
                                    mask_type=mask, qkv_layout="BTNH")


def _local(q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens, max_segments: int):
    L, S = q_BLHK.shape[1], k_BSNK.shape[1]
    with jax.named_scope(fused_tag(L, S)):
        if L == S:
            return _fused(q_BLHK, k_BSNK, v_BSNK, causal_segments(q_tokens, max_segments), causal=True)
        segments, order_BS = generator_segments(q_tokens, k_tokens, max_segments)
        take = lambda x: jnp.take_along_axis(x, order_BS[:, :, None, None], axis=1)
        return _fused(q_BLHK, take(k_BSNK), take(v_BSNK), segments, causal=False)


def cudnn_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens, block: int = 0,
                    max_segments: int = MAX_SEGMENTS) -> jax.Array:
    """cuDNN's fused attention, each sample its own segment (see the module docstring); `block`
    is unused. A call with as many keys as queries is causal (reasoner, decoder); one with more
    keys is the generator's, its queries the last L keys' tokens. Under an automatic mesh, no
    shard_map: JAX's cuDNN call has its own partitioning rule, which splits the batch (and the
    [B, M] segment arrays with it: their starts are per row) and rescales the offsets to each
    device's shard. Inside a shard_map manual over some axes (a pipeline's stages, Ulysses'
    context) that rule fails on jax 0.10.2 (`custom_partitioner` asserts on the partly manual
    sharding), so the call runs in a shard_map manual over every other axis too: rows over the
    axes that split them, heads over those that split heads, nothing left to partition. A call
    of one row goes that way under an automatic mesh too: there the rule fails Shardy's verifier
    on jax 0.10.2 ("dim mapping can't have a factor of size 1 if there are multiple factors", the
    softmax statistics' row factor of size 1), as a micro-batch of one sequence makes it."""
    del block
    call = functools.partial(_local, max_segments=max_segments)
    mesh = jax.sharding.get_abstract_mesh()
    manual = set() if mesh.empty else set(mesh.manual_axes)
    rest = tuple(a for a in ([] if mesh.empty else mesh.axis_names) if a not in manual)
    if not rest or (not manual and q_BLHK.shape[0] > 1):
        return call(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)
    sizes = dict(mesh.shape)
    rows = tuple(a for a in batch_mesh_axes() if a in rest)
    if q_BLHK.shape[0] % math.prod(sizes[a] for a in rows):
        rows = ()  # rows the mesh cannot split (one row): every device holds them whole
    heads = head_axes_among(rest, q_BLHK, k_BSNK)
    qkv, row = PartitionSpec(rows or None, None, heads or None, None), PartitionSpec(rows or None)
    return jax.shard_map(call, in_specs=(qkv, qkv, qkv, row, row), out_specs=qkv, axis_names=set(rest),
                         check_vma=False)(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)


# --- host side: the batch's rows against the budget, and the pairs cuDNN computes -------------

def check_rows(segment_arrays: dict[str, np.ndarray], max_segments: int) -> None:
    """Refuse a host batch whose rows cuDNN's packed layout cannot take: more samples than
    `max_segments` (a static shape of the step), or samples out of order (segment starts are
    computed from counts, so samples must be contiguous, numbered 1.. in order, padding after)."""
    for name, segment_BL in segment_arrays.items():
        segment_BL = np.asarray(segment_BL)
        over = np.flatnonzero(segment_BL.max(axis=1, initial=0) > max_segments)
        if over.size:
            r = int(over[0])
            raise UserError(f"attention=cudnn: row {r} of the batch holds {int(segment_BL[r].max())} samples "
                            f"({name}) but attention_max_segments={max_segments}; raise it (--exec "
                            f"attention_max_segments={int(segment_BL[r].max())}) or pack fewer samples a row")
        slot_BL = np.where(segment_BL > 0, segment_BL, max_segments + 1)
        bad = np.flatnonzero((np.diff(slot_BL, axis=1) < 0).any(axis=1))
        if bad.size:
            raise UserError(f"attention=cudnn: row {int(bad[0])} of {name} has its samples out of order; it needs "
                            f"samples contiguous and numbered 1.. in order with padding (0) after them, as the "
                            f"packer lays them out; use attention=segment for other layouts")


def segment_lengths(segment_BL: np.ndarray) -> np.ndarray:
    """[B, M] tokens of each segment id (padding, id 0, counted as a segment) per row."""
    segment_BL = np.asarray(segment_BL)
    out = np.zeros((segment_BL.shape[0], int(segment_BL.max(initial=0)) + 1), np.int64)
    np.add.at(out, (np.arange(segment_BL.shape[0])[:, None], segment_BL), 1)
    return out


def pairs_computed(q_tokens: Tokens, k_tokens: Tokens) -> np.ndarray:
    """[B] (query, key) pairs cuDNN computes per row, padding's segment included: causal calls
    T_i (T_i + 1) / 2 per segment, the generator's V_i (T_i + V_i)."""
    q_seg, k_seg = np.asarray(q_tokens.segment_BL), np.asarray(k_tokens.segment_BL)
    L, S = q_seg.shape[1], k_seg.shape[1]
    if L == S:
        n = segment_lengths(q_seg)
        return (n * (n + 1) // 2).sum(axis=1).astype(np.float64)
    v = segment_lengths(q_seg)
    t = segment_lengths(k_seg[:, :S - L])
    width = max(v.shape[1], t.shape[1])
    v, t = (np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in (v, t))
    return (v * (t + v)).sum(axis=1).astype(np.float64)

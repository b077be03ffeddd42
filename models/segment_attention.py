"""Segment-aware attention: only the (query block, key block) pairs a row's mask allows.

A packed row holds many samples, and the two-way mask lets a query see only its own sample, so
dense attention over the row computes mostly pairs it then throws away. Here each row's
sequence is cut into blocks of `block` tokens and, per row, the pairs of blocks in which some
query may see some key are listed (`row_block_pairs`: from per-block summaries of the segment
ids, so decided per batch, in the step); a flash-attention recurrence then runs over exactly that
list (a while loop as long as the list, not over every pair), forward and backward, with its own
VJP so that only the output and the per-query log-sum-exp are kept for the backward pass.

Rows are independent, so under a mesh whose batch is split (`layers.batch_mesh_axes`) the work
runs per device in a shard_map over those axes: each device lists and executes only the pairs
of its own rows, and devices whose rows need less work finish sooner. The simulator prices the
loops by the pairs of the batch it prices (`pair_counts`, `loop_tag`).

Exactness: a pair not listed is one where every (query, key) is masked, which dense masked
attention adds exact zeros for; within a listed pair masked keys get exactly zero weight. So the
result equals dense attention within float32 rounding, and a sample's outputs do not depend on
other samples' contents bit for bit (which blocks a query visits depends on the layout only).
Padding (segment 0) is treated as dense treats it: one more causal split of its own.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from xlaopt.models.layers import batch_mesh_axes
from xlaopt.models.masks import Tokens, pair_mask

# Padding (segment 0) is laid out after the samples of each region; for the interval test it
# takes an id above every sample's, so it stays contiguous too.
_PADDING_RANK = 2**30
_INT_MAX = np.iinfo(np.int32).max


def loop_tag(L: int, S: int) -> str:
    """The name scope of the pair loops of L queries over S keys (before padding to blocks): the
    simulator finds the loops' while instructions by it and gives them the trip counts of the
    batch it prices. A model's attentions differ in (L, S) (Cosmos 3: T x T and V x (T + V))."""
    return f"xlaopt_pairs_L{L}_S{S}"


def pad_to_blocks(x_BL, tokens: Tokens, block: int, pad_segment: int):
    """Pad a sequence (and its tokens) to whole blocks; padded tokens get `pad_segment`, which no
    real token has, so nothing attends to them and they see nothing."""
    pad = (-x_BL.shape[1]) % block
    if not pad:
        return x_BL, tokens
    widths = ((0, 0), (0, pad)) + ((0, 0),) * (x_BL.ndim - 2)
    tokens = Tokens(jnp.pad(tokens.segment_BL, ((0, 0), (0, pad)), constant_values=pad_segment),
                    jnp.pad(tokens.is_generator_BL, ((0, 0), (0, pad))),
                    jnp.pad(tokens.index_BL, ((0, 0), (0, pad))))
    return jnp.pad(x_BL, widths), tokens


def _pad_tokens(tokens: Tokens, block: int, pad_segment: int) -> Tokens:
    return pad_to_blocks(tokens.segment_BL, tokens, block, pad_segment)[1]


def _summary(tokens: Tokens, block: int):
    """Per block of each row: the interval of its segment ids, whether it is all reasoner, and
    the first and last index of its real tokens."""
    seg = jnp.where(tokens.segment_BL == 0, _PADDING_RANK, tokens.segment_BL)
    real = tokens.segment_BL >= 0
    seg_Bnb = seg.reshape(seg.shape[0], -1, block)
    real_Bnb = real.reshape(seg_Bnb.shape)
    idx = tokens.index_BL.reshape(seg_Bnb.shape)
    lo = jnp.where(real_Bnb, seg_Bnb, _INT_MAX).min(-1)
    hi = jnp.where(real_Bnb, seg_Bnb, -1).max(-1)
    reasoner = jnp.all(~tokens.is_generator_BL.reshape(seg_Bnb.shape) | ~real_Bnb, axis=-1)
    first = jnp.where(real_Bnb, idx, _INT_MAX).min(-1)
    last = jnp.where(real_Bnb, idx, -1).max(-1)
    return lo, hi, reasoner, first, last


def row_block_pairs(q_tokens: Tokens, k_tokens: Tokens, block: int) -> jax.Array:
    """[B, nq, nk] bool: per row, the (query block, key block) pairs in which some query may see
    some key. A superset, exact for blocks of whole samples: the blocks' segment intervals overlap
    (samples are contiguous in a packed region) and the pair is not wholly in the future of the
    reasoner's causal part. Sequences are padded to whole blocks here."""
    q_tokens, k_tokens = _pad_tokens(q_tokens, block, -2), _pad_tokens(k_tokens, block, -1)
    q_lo, q_hi, q_reasoner, _, q_last = _summary(q_tokens, block)
    k_lo, k_hi, k_reasoner, k_first, _ = _summary(k_tokens, block)
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    future = q_reasoner[:, :, None] & k_reasoner[:, None, :] & (k_first[:, None, :] > q_last[:, :, None])
    return overlap & ~future


def pair_counts(q_tokens: Tokens, k_tokens: Tokens, block: int) -> np.ndarray:
    """[B] block pairs each row executes (the trip count its rows add to a pair loop)."""
    return np.asarray(row_block_pairs(q_tokens, k_tokens, block).sum(axis=(1, 2)))


def _pair_list(needed_Bqk: jax.Array):
    """The listed pairs as (row, query block, key block) int32 [P, 3], in row-major order (so a
    query block's key blocks come in order, one after the other), and how many there are; the
    list is as long as every pair, its tail unused."""
    B, nq, nk = needed_Bqk.shape
    (flat,) = jnp.nonzero(needed_Bqk.reshape(-1), size=B * nq * nk, fill_value=0)
    items = jnp.stack([flat // (nq * nk), (flat // nk) % nq, flat % nk], axis=1).astype(jnp.int32)
    return items, needed_Bqk.sum().astype(jnp.int32)


def _take(x, row, start, size):
    return jax.lax.dynamic_slice(x, (row, start) + (0,) * (x.ndim - 2), (1, size) + x.shape[2:])[0]


def _put(x, value, row, start):
    return jax.lax.dynamic_update_slice(x, value[None].astype(x.dtype), (row, start) + (0,) * (x.ndim - 2))


def _block_tokens(tokens: Tokens, row, start, block) -> Tokens:
    return Tokens(*(_take(a, row, start, block)[None] for a in tokens))


def _logits(q_bNRK, k_bNK, q_tok: Tokens, k_tok: Tokens):
    """Masked, scaled logits [b, N, R, b] of one block pair, and the mask [b, 1, 1, b]."""
    scale = q_bNRK.shape[-1] ** -0.5
    logits = jnp.einsum("lnrk,snk->lnrs", q_bNRK, k_bNK, preferred_element_type=jnp.float32) * scale
    mask = pair_mask(q_tok, k_tok)[0][:, None, None, :]
    return jnp.where(mask, logits, -jnp.inf), mask


def _while(count, body, init):
    return jax.lax.while_loop(lambda c: c[0] < count, lambda c: (c[0] + 1,) + body(c[0], c[1:]), (0,) + init)[1:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q_BLNRK, k_BSNK, v_BSNK, q_tokens, k_tokens, block, tag):
    return _flash_fwd(q_BLNRK, k_BSNK, v_BSNK, q_tokens, k_tokens, block, tag)[0]


def _flash_fwd(q_BLNRK, k_BSNK, v_BSNK, q_tokens, k_tokens, block, tag):
    B, L, N, R, K = q_BLNRK.shape
    items, count = _pair_list(row_block_pairs(q_tokens, k_tokens, block))

    def body(i, carry):
        m_BLNR, l_BLNR, acc_BLNRK = carry
        row, qs, ks = items[i, 0], items[i, 1] * block, items[i, 2] * block
        logits, _ = _logits(_take(q_BLNRK, row, qs, block), _take(k_BSNK, row, ks, block),
                            _block_tokens(q_tokens, row, qs, block), _block_tokens(k_tokens, row, ks, block))
        m, l, acc = (_take(a, row, qs, block) for a in carry)
        m_new = jnp.maximum(m, logits.max(-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # queries that have seen nothing yet
        p = jnp.exp(logits - shift[..., None])
        rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - shift), 0.0)
        pv = jnp.einsum("lnrs,snk->lnrk", p.astype(v_BSNK.dtype), _take(v_BSNK, row, ks, block),
                        preferred_element_type=jnp.float32)
        return (_put(m_BLNR, m_new, row, qs), _put(l_BLNR, l * rescale + p.sum(-1), row, qs),
                _put(acc_BLNRK, acc * rescale[..., None] + pv, row, qs))

    with jax.named_scope(tag):
        m, l, acc = _while(count, body, (jnp.full((B, L, N, R), -jnp.inf), jnp.zeros((B, L, N, R)),
                                         jnp.zeros((B, L, N, R, K))))
    seen = l > 0  # queries of padded positions saw nothing: output 0, never 0/0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0).astype(v_BSNK.dtype)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, (q_BLNRK, k_BSNK, v_BSNK, q_tokens, k_tokens, out, lse, items, count)


def _flash_bwd(block, tag, residuals, d_out):
    """The flash-attention backward over the same pair list: probabilities recomputed from the
    saved log-sum-exp, gradients accumulated block by block in float32."""
    q_BLNRK, k_BSNK, v_BSNK, q_tokens, k_tokens, out, lse, items, count = residuals
    B, L, N, R, K = q_BLNRK.shape
    scale = K ** -0.5
    delta_BLNR = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def body(i, carry):
        dq_BLNRK, dk_BSNK, dv_BSNK = carry
        row, qs, ks = items[i, 0], items[i, 1] * block, items[i, 2] * block
        q, k, v = _take(q_BLNRK, row, qs, block), _take(k_BSNK, row, ks, block), _take(v_BSNK, row, ks, block)
        logits, mask = _logits(q, k, _block_tokens(q_tokens, row, qs, block), _block_tokens(k_tokens, row, ks, block))
        p = jnp.where(mask, jnp.exp(logits - _take(lse, row, qs, block)[..., None]), 0.0)
        do = _take(d_out, row, qs, block)
        dv = jnp.einsum("lnrs,lnrk->snk", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.einsum("lnrk,snk->lnrs", do, v, preferred_element_type=jnp.float32)
        ds = (p * (dp - _take(delta_BLNR, row, qs, block)[..., None]) * scale).astype(q.dtype)
        dq = jnp.einsum("lnrs,snk->lnrk", ds, k, preferred_element_type=jnp.float32)
        dk = jnp.einsum("lnrs,lnrk->snk", ds, q, preferred_element_type=jnp.float32)
        return (_put(dq_BLNRK, _take(dq_BLNRK, row, qs, block) + dq, row, qs),
                _put(dk_BSNK, _take(dk_BSNK, row, ks, block) + dk, row, ks),
                _put(dv_BSNK, _take(dv_BSNK, row, ks, block) + dv, row, ks))

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    with jax.named_scope(tag):
        dq, dk, dv = _while(count, body, (zeros(q_BLNRK), zeros(k_BSNK), zeros(v_BSNK)))
    return dq.astype(q_BLNRK.dtype), dk.astype(k_BSNK.dtype), dv.astype(v_BSNK.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _local(q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens, block: int) -> jax.Array:
    B, L, H, K = q_BLHK.shape
    N = k_BSNK.shape[2]
    q_BLHK, q_padded = pad_to_blocks(q_BLHK, q_tokens, block, -2)
    k_BSNK, k_padded = pad_to_blocks(k_BSNK, k_tokens, block, -1)
    v_BSNK, _ = pad_to_blocks(v_BSNK, k_tokens, block, -1)
    Lp = q_BLHK.shape[1]
    tag = loop_tag(L, k_tokens.segment_BL.shape[1])
    out = _flash(q_BLHK.reshape(B, Lp, N, H // N, K), k_BSNK, v_BSNK, q_padded, k_padded, block, tag)
    return out.reshape(B, Lp, H, K)[:, :L]


def segment_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens, block: int) -> jax.Array:
    """Attention of the (query block, key block) pairs each row's mask allows (see the module
    docstring); per device under a mesh that splits the batch."""
    axes = batch_mesh_axes()
    local = functools.partial(_local, block=block)
    if not axes:
        return local(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)
    rows = PartitionSpec(axes)
    return jax.shard_map(local, in_specs=(rows,) * 5, out_specs=rows, axis_names=set(axes),
                         check_vma=False)(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)

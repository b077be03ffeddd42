"""Attention implementations, chosen by name in the execution config (`attention`).

Every implementation takes the same arguments, `(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens,
block)`, and gives [B, L, H, K]: queries over keys under the two-way mask of `masks.pair_mask`.
  dense      masked attention over every (query, key) pair;
  blockwise  scanned over key blocks of `block` keys with an online softmax (memory O(L x block));
  io_only    a pricing stand-in with wrong values (see `attention_io_only`); never train with it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from xlaopt.models.masks import Tokens, pair_mask


def dense_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int = 0) -> jax.Array:
    """Masked attention over every (query, key) pair; `block` is unused."""
    del block
    return attention(q_BLHK, k_BSNK, v_BSNK, pair_mask(q_tokens, k_tokens))


def blockwise_or_dense(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int) -> jax.Array:
    """Blockwise when there are more keys than one block, else dense (the same numbers)."""
    if k_BSNK.shape[1] <= block:
        return dense_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)
    return blockwise_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block)


def blockwise_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int) -> jax.Array:
    """Attention scanned over key blocks with a running max and sum (Rabe & Staats; the
    flash-attention recurrence), rematerialised in the backward pass. Masked keys add exact
    zeros, so what a query may not see cannot change its output, bit for bit."""
    B, L, H, K = q_BLHK.shape
    S, N = k_BSNK.shape[1], k_BSNK.shape[2]
    pad = (-S) % block
    if pad:  # padded keys belong to no sample (segment -1), so nothing attends to them
        k_BSNK = jnp.pad(k_BSNK, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v_BSNK = jnp.pad(v_BSNK, ((0, 0), (0, pad), (0, 0), (0, 0)))
        k_tokens = Tokens(jnp.pad(k_tokens.segment_BL, ((0, 0), (0, pad)), constant_values=-1),
                          jnp.pad(k_tokens.is_generator_BL, ((0, 0), (0, pad))),
                          jnp.pad(k_tokens.index_BL, ((0, 0), (0, pad))))
    nb = (S + pad) // block
    blocks = lambda a: jnp.moveaxis(a.reshape((B, nb, block) + a.shape[2:]), 1, 0)
    q_BLNRK = q_BLHK.reshape(B, L, N, H // N, K)

    @jax.checkpoint
    def step(carry, xs):
        m_BNRL, l_BNRL, acc_BLNRK = carry
        k_BbNK, v_BbNK, seg, gen, idx = xs
        logits = jnp.einsum("blnrk,bsnk->bnrls", q_BLNRK, k_BbNK, preferred_element_type=jnp.float32) * (K ** -0.5)
        mask_BLb = pair_mask(q_tokens, Tokens(seg, gen, idx))
        logits = jnp.where(mask_BLb[:, None, None], logits, -jnp.inf)
        m_new = jnp.maximum(m_BNRL, logits.max(-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen nothing yet
        p = jnp.exp(logits - shift[..., None])
        rescale = jnp.where(jnp.isfinite(m_BNRL), jnp.exp(m_BNRL - shift), 0.0)
        l_new = l_BNRL * rescale + p.sum(-1)
        pv = jnp.einsum("bnrls,bsnk->blnrk", p.astype(v_BbNK.dtype), v_BbNK, preferred_element_type=jnp.float32)
        acc_new = acc_BLNRK * jnp.moveaxis(rescale, -1, 1)[..., None] + pv
        return (m_new, l_new, acc_new), None

    R = H // N
    init = (jnp.full((B, N, R, L), -jnp.inf, jnp.float32), jnp.zeros((B, N, R, L), jnp.float32),
            jnp.zeros((B, L, N, R, K), jnp.float32))
    xs = (blocks(k_BSNK), blocks(v_BSNK), blocks(k_tokens.segment_BL), blocks(k_tokens.is_generator_BL),
          blocks(k_tokens.index_BL))
    (_, l_BNRL, acc_BLNRK), _ = jax.lax.scan(step, init, xs)
    out = acc_BLNRK / jnp.moveaxis(l_BNRL, -1, 1)[..., None]
    return out.reshape(B, L, H, K).astype(v_BSNK.dtype)


def attention(q_BLHK: jax.Array, k_BSNK: jax.Array, v_BSNK: jax.Array, mask_BLS: jax.Array) -> jax.Array:
    """Grouped-query attention of L queries over S keys under a boolean mask (True = may attend).

    Softmax in fp32. Every query row must allow at least one key (itself), so masked
    keys get exactly zero weight and cannot leak into the output, bit for bit.
    """
    B, L, H, K = q_BLHK.shape
    N = k_BSNK.shape[2]
    q_BLNRK = q_BLHK.reshape(B, L, N, H // N, K)
    logits_BNRLS = jnp.einsum("blnrk,bsnk->bnrls", q_BLNRK, k_BSNK,
                              preferred_element_type=jnp.float32) * (K ** -0.5)
    logits_BNRLS = jnp.where(mask_BLS[:, None, None], logits_BNRLS, -jnp.inf)
    probs_BNRLS = jax.nn.softmax(logits_BNRLS, axis=-1).astype(v_BSNK.dtype)
    out_BLNRK = jnp.einsum("bnrls,bsnk->blnrk", probs_BNRLS, v_BSNK)
    return out_BLNRK.reshape(B, L, H, K)


def attention_io_only(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int = 0) -> jax.Array:
    """A pricing stand-in for a fused (flash) attention kernel, for `xlaopt calibrate --method
    compiled` only: its values are wrong on purpose, never train with it. It takes the same
    inputs and gives the same output shape as `attend`, uses every input (so the q, k, v
    projections and their gradients stay in the step) and does elementwise work only: what it
    leaves in the HLO is the kernel's q, k, v, o traffic, while the kernel's FLOPs are priced
    separately (`costmodel.attention_time_s`)."""
    del q_tokens, k_tokens, block
    B, L, H, K = q_BLHK.shape
    N = k_BSNK.shape[2]
    q_BLNRK = q_BLHK.reshape(B, L, N, H // N, K)
    return (q_BLNRK * k_BSNK[:, :, :, None, :] + v_BSNK[:, :, :, None, :]).reshape(B, L, H, K)


# The execution config's `attention` names one of these.
ATTENTION = {"dense": dense_attention, "blockwise": blockwise_or_dense, "io_only": attention_io_only}


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Which implementation a model's layers attend with, and its key block (blockwise only)."""
    impl: str = "dense"
    block: int = 512

    def __post_init__(self):
        if self.impl not in ATTENTION:
            raise ValueError(f"attention {self.impl!r}; use one of {', '.join(ATTENTION)}")
        if self.block <= 0:
            raise ValueError(f"attention block {self.block} must be positive")

    def __call__(self, q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens) -> jax.Array:
        return ATTENTION[self.impl](q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, self.block)

"""Attention implementations, chosen by name in the execution config (`attention`).

Every implementation takes the same arguments, `(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens,
block)`, and gives [B, L, H, K]: queries over keys under the two-way mask of `masks.pair_mask`.
  dense      masked attention over every (query, key) pair;
  blockwise  scanned over key blocks of `block` keys with an online softmax (memory O(L x block));
  segment    blocks of queries and keys, only the pairs each row's mask allows (other samples
             and the reasoner's causal future skipped), decided per batch from the segment ids
             (`xlaopt.models.segment_attention`);
  cudnn      JAX's fused cuDNN attention, each sample a segment of its own (NVIDIA GPUs only:
             `xlaopt.models.cudnn_attention`);
  io_only    a pricing stand-in with wrong values (see `attention_io_only`); never train with it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from xlaopt.models.cudnn_attention import MAX_SEGMENTS, cudnn_attention
from xlaopt.models.masks import Tokens, pair_mask
from xlaopt.models.segment_attention import pad_to_blocks, segment_attention
from xlaopt.models.tracing import installed


def dense_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int = 0) -> jax.Array:
    """Masked attention over every (query, key) pair; `block` is unused."""
    del block
    return attention(q_BLHK, k_BSNK, v_BSNK, pair_mask(q_tokens, k_tokens))


def blockwise_or_dense(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int) -> jax.Array:
    """Blockwise when there are more keys than one block, else dense (the same numbers)."""
    if k_BSNK.shape[1] <= block:
        return dense_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)
    return blockwise_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block)


def _online_update(carry, q_BLNRK, q_tokens: Tokens, k_BbNK, v_BbNK, k_tokens: Tokens):
    """One key block into the running (max, sum, output) of the flash-attention recurrence."""
    m_BNRL, l_BNRL, acc_BLNRK = carry
    K = q_BLNRK.shape[-1]
    logits = jnp.einsum("blnrk,bsnk->bnrls", q_BLNRK, k_BbNK, preferred_element_type=jnp.float32) * (K ** -0.5)
    logits = jnp.where(pair_mask(q_tokens, k_tokens)[:, None, None], logits, -jnp.inf)
    m_new = jnp.maximum(m_BNRL, logits.max(-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen nothing yet
    p = jnp.exp(logits - shift[..., None])
    rescale = jnp.where(jnp.isfinite(m_BNRL), jnp.exp(m_BNRL - shift), 0.0)
    l_new = l_BNRL * rescale + p.sum(-1)
    pv = jnp.einsum("bnrls,bsnk->blnrk", p.astype(v_BbNK.dtype), v_BbNK, preferred_element_type=jnp.float32)
    return m_new, l_new, acc_BLNRK * jnp.moveaxis(rescale, -1, 1)[..., None] + pv


def _blocks(a, block: int):
    """[B, L, ...] -> [L / block, B, block, ...]: blocks first, for a scan."""
    B, L = a.shape[:2]
    return jnp.moveaxis(a.reshape((B, L // block, block) + a.shape[2:]), 1, 0)


def _init_carry(B, L, N, R, K):
    return (jnp.full((B, N, R, L), -jnp.inf, jnp.float32), jnp.zeros((B, N, R, L), jnp.float32),
            jnp.zeros((B, L, N, R, K), jnp.float32))


def blockwise_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int) -> jax.Array:
    """Attention scanned over key blocks with a running max and sum (Rabe & Staats; the
    flash-attention recurrence), rematerialised in the backward pass. Masked keys add exact
    zeros, so what a query may not see cannot change its output, bit for bit."""
    B, L, H, K = q_BLHK.shape
    N = k_BSNK.shape[2]
    k_BSNK, padded = pad_to_blocks(k_BSNK, k_tokens, block, -1)
    v_BSNK, _ = pad_to_blocks(v_BSNK, k_tokens, block, -1)
    q_BLNRK = q_BLHK.reshape(B, L, N, H // N, K)

    @jax.checkpoint
    def step(carry, xs):
        k_BbNK, v_BbNK, seg, gen, idx = xs
        return _online_update(carry, q_BLNRK, q_tokens, k_BbNK, v_BbNK, Tokens(seg, gen, idx)), None

    xs = (_blocks(k_BSNK, block), _blocks(v_BSNK, block)) + tuple(_blocks(t, block) for t in padded)
    (_, l_BNRL, acc_BLNRK), _ = jax.lax.scan(step, _init_carry(B, L, N, H // N, K), xs)
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
    if k_BSNK.shape[1] != L:  # queries over other keys (Cosmos 3's generator): each query reads the keys' mean
        k_BSNK, v_BSNK = (jnp.broadcast_to(x.mean(1, keepdims=True), (B, L) + x.shape[2:]) for x in (k_BSNK, v_BSNK))
    return (q_BLNRK * k_BSNK[:, :, :, None, :] + v_BSNK[:, :, :, None, :]).reshape(B, L, H, K)


# How an implementation is called: directly, unless a rewrite installs a wrapper
# `(attend, q, k, v, q_tokens, k_tokens) -> out` that calls `attend(q, k, v, q_tokens, k_tokens)`
# its own way (context parallel: `xlaopt.transforms.ulysses_attention`).
_ATTENTION_WRAPPER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_attention_wrapper",
                                                                                    default=None)
# The mesh axis over which the installed wrapper gathers each attention's whole sequence from the
# chunks it splits: outside attention every op reads its own tokens only, so code around the
# attention (a pipeline's stage) may take that axis manual and run on the chunks.
_SEQUENCE_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("xlaopt_attention_sequence_axis",
                                                                            default=None)


@contextlib.contextmanager
def attention_through(wrapper: Callable, sequence_axis: str | None = None):
    """Context manager installing an attention wrapper (see `_ATTENTION_WRAPPER`) that attends
    over the whole sequence split over `sequence_axis`, where it names one."""
    with installed(_ATTENTION_WRAPPER, wrapper), installed(_SEQUENCE_AXIS, sequence_axis):
        yield


def attention_sequence_axis() -> str | None:
    """The mesh axis whose sequence chunks the installed attention wrapper gathers, if any."""
    return _SEQUENCE_AXIS.get()


# The execution config's `attention` names one of these.
ATTENTION = {"dense": dense_attention, "blockwise": blockwise_or_dense, "segment": segment_attention,
             "cudnn": cudnn_attention, "io_only": attention_io_only}


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Which implementation a model's layers attend with, its key block (blockwise, segment) and
    the samples a row may hold (cudnn: a static shape of its packed layout)."""
    impl: str = "dense"
    block: int = 512
    max_segments: int = MAX_SEGMENTS

    def __post_init__(self):
        if self.impl not in ATTENTION:
            raise ValueError(f"attention {self.impl!r}; use one of {', '.join(ATTENTION)}")
        if self.block <= 0 or self.max_segments <= 0:
            raise ValueError(f"attention block {self.block} and max_segments {self.max_segments} must be positive")

    def __call__(self, q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens) -> jax.Array:
        impl = ATTENTION[self.impl]
        if self.impl == "cudnn":  # the one implementation with a static segment budget
            impl = functools.partial(impl, max_segments=self.max_segments)
        attend = functools.partial(_call, impl, self.block)
        wrapper = _ATTENTION_WRAPPER.get()
        if wrapper is None:
            return attend(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)
        return wrapper(attend, q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)


def _call(impl, block, q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens):
    return impl(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block)

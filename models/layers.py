"""Building blocks shared by the towers: parameters with logical axes, RMSNorm, MLP, attention.

Shape letters used in names throughout `xlaopt.models`:
  B batch, T reasoner (text) tokens, V generator tokens, S = T + V, D d_model,
  H query heads, N kv heads, R = H / N (queries per kv head), K head_dim, F mlp_dim,
  E vocab, C generator raw-input channels.

Logical axis names (mapped to mesh axes by the one rule table in `xlaopt.sharding`):
  parameters: vocab, embed, heads, kv_heads, head_dim, mlp, latent, domains, modality,
              time_freq, time_hidden (and layers, added by the scan);
  activations: batch, seq, act_embed, act_heads, act_kv_heads, act_mlp, act_vocab.
"""
from __future__ import annotations

import contextvars
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

# The sharding constraint for activations is installed by whoever traces the model
# (the training program); the model itself only names logical axes.
_ACTIVATION_CONSTRAINT: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "xlaopt_activation_constraint", default=None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Annotate an activation with logical axes; a no-op unless a constraint is installed."""
    assert x.ndim == len(logical_axes), (x.shape, logical_axes)
    fn = _ACTIVATION_CONSTRAINT.get()
    return x if fn is None else fn(x, tuple(logical_axes))


class activation_constraint:
    """Context manager installing `fn(x, logical_axes) -> x` while a model is traced."""

    def __init__(self, fn: Callable | None):
        self._fn = fn

    def __enter__(self):
        self._token = _ACTIVATION_CONSTRAINT.set(self._fn)

    def __exit__(self, *exc):
        _ACTIVATION_CONSTRAINT.reset(self._token)


def param(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
          init: Callable | None = None, fan_in_axes: Sequence[int] = (0,),
          batch_axes: Sequence[int] = ()) -> jax.Array:
    """An fp32 master parameter annotated with logical axes (fan-in scaled normal by default)."""
    if init is None:
        out_axes = tuple(i for i in range(len(shape)) if i not in fan_in_axes and i not in batch_axes)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=tuple(fan_in_axes),
                                                out_axis=out_axes, batch_axis=tuple(batch_axes))
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), jnp.float32)


def embedding_lookup(table_XD: jax.Array, ids, row_axis: str) -> jax.Array:
    """Rows of a table; the table is first made whole along embed (as FSDP gathers any
    weight before use) so the output can take the batch sharding without the partitioner
    falling back to a full rematerialisation."""
    table_XD = constrain(table_XD, (row_axis, "act_embed"))
    return jnp.take(table_XD, ids, axis=0)


def next_token_loss(logits_BTE: jax.Array, tokens_BT: jax.Array, seg_BT: jax.Array) -> jax.Array:
    """Mean cross-entropy of each token's successor, where the successor belongs to the same
    (real, non-padding) sample."""
    has_next_BT = jnp.pad((seg_BT[:, 1:] == seg_BT[:, :-1]) & (seg_BT[:, :-1] != 0), ((0, 0), (0, 1)))
    targets_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))
    nll_BT = -jnp.take_along_axis(jax.nn.log_softmax(logits_BTE, axis=-1), targets_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(has_next_BT, nll_BT, 0.0)) / jnp.maximum(jnp.sum(has_next_BT), 1)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


class RMSNorm(nn.Module):
    dim: int
    axis_name: str
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", (self.dim,), (self.axis_name,), nn.initializers.ones)
        return rms_norm(x, scale, self.eps)


class Mlp(nn.Module):
    d_model: int
    mlp_dim: int
    activation: str
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        D, F = self.d_model, self.mlp_dim
        up_DF = param(self, "up_DF", (D, F), ("embed", "mlp")).astype(self.dtype)
        down_FD = param(self, "down_FD", (F, D), ("mlp", "embed")).astype(self.dtype)
        up_BLF = jnp.einsum("bld,df->blf", x_BLD, up_DF)
        if self.activation == "swiglu":
            gate_DF = param(self, "gate_DF", (D, F), ("embed", "mlp")).astype(self.dtype)
            h_BLF = nn.silu(jnp.einsum("bld,df->blf", x_BLD, gate_DF)) * up_BLF
        elif self.activation == "relu2":
            h_BLF = jnp.square(nn.relu(up_BLF))
        else:  # gelu (GPT, MPT)
            h_BLF = nn.gelu(up_BLF)
        h_BLF = constrain(h_BLF, ("batch", "seq", "act_mlp"))
        return jnp.einsum("blf,fd->bld", h_BLF, down_FD)


def attend(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int = 0) -> jax.Array:
    """Masked attention of queries over keys, dense or, when `block` > 0 and there are more
    keys than that, blockwise with an online softmax (memory O(L x block) instead of O(L x S))."""
    from xlaopt.models.masks import pair_mask

    S = k_BSNK.shape[1]
    if block <= 0 or S <= block:
        return attention(q_BLHK, k_BSNK, v_BSNK, pair_mask(q_tokens, k_tokens))
    return blockwise_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block)


def blockwise_attention(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens, block: int) -> jax.Array:
    """Attention scanned over key blocks with a running max and sum (Rabe & Staats; the
    flash-attention recurrence), rematerialised in the backward pass. Masked keys add exact
    zeros, so what a query may not see cannot change its output, bit for bit."""
    from xlaopt.models.masks import Tokens, pair_mask

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

"""A generic decoder-only LLM (Llama style: RMSNorm, GQA, RoPE, SwiGLU; GELU MLP for GPT/MPT
style rows), for calibrating the cost model on published runs and as the first of the
mainstream models the passes serve. Packed documents are separated by segment ids.

Batch contract: tokens_BT, segment_ids_BT (0 = padding), positions_BT.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.models.attention import AttentionSpec
from xlaopt.models.block import TransformerBlock
from xlaopt.models.layers import (
    RESIDUAL_BLD,
    RMSNorm,
    constrain,
    embedding_lookup,
    gathered,
    head_logits,
    next_tokens,
    one_hot_nll,
    param,
    rms_norm,
    token_count,
    token_mean,
    token_nll,
)
from xlaopt.models.masks import Tokens
from xlaopt.models.mrope import rope_cos_sin
from xlaopt.models.registry import ConfigError, register
from xlaopt.models.rope_scaling import llama3_inv_freq
from xlaopt.models.stack import LayerStack, StackSpec
from xlaopt.models.transformer_config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class DecoderConfig(TransformerConfig):
    """MLP: "swiglu" (Llama), "gelu" (GPT, MPT) or "relu2". How attention is computed is an
    execution setting, not part of the model (`xlaopt.execution`)."""
    family: ClassVar[str] = "decoder"
    qk_norm: bool = False
    tie_embeddings: bool = False
    # Llama 3.1's RoPE frequency scaling (`models.rope_scaling`); factor 1: none.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192

    def __post_init__(self):
        super().__post_init__()
        if self.rope_scaling_factor < 1 or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(f"{self.name}: rope_scaling_factor={self.rope_scaling_factor} must be >= 1 and "
                              f"0 < rope_low_freq_factor ({self.rope_low_freq_factor}) < rope_high_freq_factor "
                              f"({self.rope_high_freq_factor})")

    def rope_inv_freq(self) -> tuple[float, ...] | None:
        """The rotary inverse frequencies when scaled; None: rope_theta's own."""
        if self.rope_scaling_factor == 1:
            return None
        return tuple(float(f) for f in llama3_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling_factor,
                                                       self.rope_low_freq_factor, self.rope_high_freq_factor,
                                                       self.rope_original_max_positions))


def document_tokens(seg_BT) -> Tokens:
    return Tokens.of(seg_BT, jnp.zeros(seg_BT.shape, bool))  # causal within each document


def attention_calls(batch: dict) -> tuple[tuple[Tokens, Tokens], ...]:
    """(queries, keys) of the one attention a layer computes."""
    tokens_T = document_tokens(jnp.asarray(batch["segment_ids_BT"]))
    return ((tokens_T, tokens_T),)


def block_fields(c: DecoderConfig, dtype) -> dict:
    """The `TransformerBlock` fields of every layer: one definition for training and for
    KV-cached decoding (`xlaopt.inference.decode`), which binds the same block."""
    return dict(c.block_fields(dtype), qk_norm=c.qk_norm)


def rope_tables(c: DecoderConfig, positions_3BL):
    """cos, sin [B, L, K] of 1-D positions (all three rows equal: every frequency follows row 0)."""
    return rope_cos_sin(positions_3BL, c.head_dim, (c.head_dim // 2, 0, 0), c.rope_theta, c.rope_inv_freq())


class DecoderLayer(nn.Module):
    block: dict
    attention: AttentionSpec = AttentionSpec()

    @nn.compact
    def __call__(self, x_BTD, tokens_T, rope):
        block = TransformerBlock(name="block", **self.block)
        q_BTHK, k_BTNK, v_BTNK, _ = block.qkv(x_BTD, *rope)
        attn_BTHK = self.attention(q_BTHK, k_BTNK, v_BTNK, tokens_T, tokens_T)
        return block.finish(x_BTD, attn_BTHK)


class Decoder(nn.Module):
    config: DecoderConfig
    dtype: jnp.dtype = jnp.bfloat16
    stack: StackSpec = StackSpec()
    attention: AttentionSpec = AttentionSpec()

    @nn.compact
    def __call__(self, batch: dict, loss: bool = False) -> jax.Array:
        """Next-token logits [B, T, E] in fp32, or with `loss` the mean next-token loss. Where the
        stack runs the loss inside it (a 1F1B pipeline), the final norm, head and loss are its
        tail, run on each micro-batch on the last stage."""
        x_BTD, tokens_T, rope, embed_ED = self._embedded(batch)
        stack = LayerStack(DecoderLayer, dict(block=block_fields(self.config, self.dtype), attention=self.attention),
                           self.config.num_layers, self.stack, name="layers")
        final_norm = RMSNorm(self.config.d_model, "embed", self.config.norm_eps, name="final_norm")
        if loss:
            targets_BT, has_next_BT = next_tokens(batch["tokens_BT"], batch["segment_ids_BT"])
        if loss and self.stack.loss_inside and not self.is_initializing():
            tail_params = {"norm": nn.meta.unbox(self.variables["params"]["final_norm"]["scale"]),
                           "head_DE": self._head_DE(embed_ED)}
            tail = functools.partial(_nll_sum, self.config.norm_eps, self.dtype)
            loss, _ = stack.loss(x_BTD, (tokens_T, rope), tail, tail_params, (targets_BT, has_next_BT),
                                 1.0 / jnp.maximum(token_count(has_next_BT), 1))  # token_mean's share
            return loss
        logits_BTE = _logits(gathered(final_norm(stack(x_BTD, tokens_T, rope))), self._head_DE(embed_ED), self.dtype)
        return token_mean(token_nll(logits_BTE, targets_BT), has_next_BT) if loss else logits_BTE

    def _embedded(self, batch: dict):
        """(x_BTD, tokens_T, rope, embed_ED): the stack's input and arguments, and the embedding."""
        c, dt = self.config, self.dtype
        seg_BT = batch["segment_ids_BT"]
        embed_ED = param(self, "embed_ED", (c.vocab_size, c.d_model), ("vocab", "embed"), nn.initializers.normal(1.0))
        x_BTD = constrain(embedding_lookup(embed_ED, batch["tokens_BT"], "vocab").astype(dt), RESIDUAL_BLD)
        rope = rope_tables(c, jnp.broadcast_to(batch["positions_BT"], (3,) + seg_BT.shape))
        return x_BTD, document_tokens(seg_BT), rope, embed_ED

    def _head_DE(self, embed_ED: jax.Array) -> jax.Array:
        c = self.config
        return embed_ED.T if c.tie_embeddings else param(self, "lm_head_DE", (c.d_model, c.vocab_size),
                                                         ("embed", "vocab"))


def _logits(h_BTD, head_DE, dtype) -> jax.Array:
    return constrain(head_logits(h_BTD, head_DE.astype(dtype)), ("batch", "seq", "act_vocab"))


def _nll_sum(eps: float, dtype, tail_params: dict, x_BTD, targets: tuple, scale) -> jax.Array:
    """A 1F1B stack's tail: the final norm, head and next-token cross-entropy of its rows, summed
    and scaled by `scale` (one over the batch's token count); no metrics beside."""
    targets_BT, has_next_BT = targets
    logits_BTE = _logits(gathered(rms_norm(x_BTD, tail_params["norm"], eps)), tail_params["head_DE"], dtype)
    return jnp.sum(jnp.where(has_next_BT, one_hot_nll(logits_BTE, targets_BT), 0.0)) * scale, {}


def loss_fn(model: Decoder, params, batch: dict, key) -> tuple[jax.Array, dict]:
    del key  # no sampling in a language-model step
    loss = model.apply({"params": params}, batch, loss=True)
    return loss, {"loss_text": loss}


def forward_flops(c: DecoderConfig, n_tokens) -> np.ndarray:
    """Forward model FLOPs of documents of `n_tokens`: weights, causal attention (half the
    square), LM head."""
    n = np.asarray(n_tokens, np.float64)
    mlp = (3 if c.mlp_activation == "swiglu" else 2) * c.d_model * c.mlp_dim
    weights = 2 * c.d_model * c.num_heads * c.head_dim + 2 * c.d_model * c.num_kv_heads * c.head_dim + mlp
    return 2 * c.num_layers * weights * n + c.num_layers * 2 * c.num_heads * c.head_dim * n**2 + 2 * c.d_model * c.vocab_size * n


def batch_train_flops(c: DecoderConfig, batch: dict[str, np.ndarray]) -> float:
    seg = batch["segment_ids_BT"]
    total = 0.0
    for row in seg:
        counts = np.bincount(row)[1:]
        total += float(np.sum(3.0 * forward_flops(c, counts[counts > 0])))
    return total


register("llama-tiny", DecoderConfig, vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
         mlp_dim=768, rope_theta=1e4)
register("llama2-7b", DecoderConfig, vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32,
         mlp_dim=11008, rope_theta=1e4)
# Llama 3.1's shapes and RoPE (theta 5e5, frequencies scaled 8x beyond 8,192 positions).
LLAMA3_ROPE = dict(rope_theta=5e5, rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_positions=8192)
register("llama3-8b", DecoderConfig, vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
         mlp_dim=14336, **LLAMA3_ROPE)
register("llama3-70b", DecoderConfig, vocab_size=128256, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
         mlp_dim=28672, **LLAMA3_ROPE)
register("llama3-405b", DecoderConfig, vocab_size=128256, d_model=16384, num_layers=126, num_heads=128, num_kv_heads=8,
         mlp_dim=53248, **LLAMA3_ROPE)

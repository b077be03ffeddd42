"""A registered model as the analytic cost model's shape (`xlaopt.analysis.analytic`).

A decoder is a `DecoderShape`; a ViT a one-tower `MoTShape` (bidirectional attention, its head
scoring one pooled vector an image). Cosmos 3 is a Mixture-of-Transformers: every layer holds two
towers' weights (each gathered and reduced whole by FSDP) while each token passes through one
of them; its attention is what the packed rows' mask allows (or what the implementation
executes of it), and its LM head runs on text tokens only. `MoTShape` says exactly that and
nothing else differs, so the collectives, recomputation and pipeline model are shared.
"""
from __future__ import annotations

import dataclasses
import functools

from xlaopt.analysis.analytic import DecoderShape


@dataclasses.dataclass(frozen=True)
class MoTShape(DecoderShape):
    towers: int = 2
    attention_flops_per_row: float = 0.0  # forward, one layer, all heads: 4 H dh x (query, key) pairs executed
    text_fraction: float = 1.0  # of a row's tokens: the LM head's share

    @functools.cached_property
    def layer_params(self) -> int:
        return self.towers * sum(self.layer_matmuls())

    def linear_forward_flops(self, tokens: float) -> float:
        return 2.0 * tokens * sum(self.layer_matmuls())  # one tower per token

    def attention_forward_flops(self, sequences: float, seq_len: int) -> float:
        return sequences * self.attention_flops_per_row

    def head_forward_flops(self, tokens: float) -> float:
        return 2.0 * tokens * self.text_fraction * self.d_model * self.vocab


def analytic_shape(config, pairs_executed_per_row: float | None = None, text_fraction: float = 1.0) -> DecoderShape:
    """The shape of a registered config. Cosmos 3 needs the priced rows' attention pairs."""
    mlp = "swiglu" if config.mlp_activation == "swiglu" else "gelu"  # relu2 and gelu: two matmuls
    common = dict(layers=config.num_layers, d_model=config.d_model, heads=config.num_heads,
                  kv_heads=config.num_kv_heads, ffn=config.mlp_dim, vocab=config.vocab_size, mlp=mlp,
                  kv_channels=config.head_dim)
    if config.family == "decoder":
        return DecoderShape(**common, tied_embeddings=config.tie_embeddings)
    if config.family == "vit":  # one tower, every token sees its whole image, the head on one pooled vector an image
        T = config.tokens
        return MoTShape(**common, towers=1, attention_flops_per_row=4.0 * config.num_heads * config.head_dim * T * T,
                        text_fraction=1.0 / T)
    if pairs_executed_per_row is None:
        raise ValueError("a Cosmos 3 shape needs the attention pairs its rows execute")
    return MoTShape(**common, attention_flops_per_row=4.0 * config.num_heads * config.head_dim * pairs_executed_per_row,
                    text_fraction=text_fraction)

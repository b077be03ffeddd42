"""A registered model as the analytic cost model's shape (`xlaopt.analysis.analytic`).

A decoder is a `DecoderShape`; a ViT a one-tower `MoTShape` (bidirectional attention, its head
scoring one pooled vector an image). Cosmos 3 is a Mixture-of-Transformers: every layer holds two
towers' weights (each gathered and reduced whole by FSDP) while each token passes through one
of them; its attention is what the packed rows' mask allows (or what the implementation
executes of it), and its LM head runs on text tokens only. `MoTShape` says exactly that and
nothing else differs, so the collectives, recomputation and pipeline model are shared.

A ResNet is a `ConvShape`: its convolutions as that many "layers" of their mean size (a token is
an image), which is what the step model needs to price data parallelism and FSDP (FLOPs, the
parameters each layer gathers and reduces, the activations each keeps); the per-layer spread
of real sizes is left to the compiled price of the few best candidates.
"""
from __future__ import annotations

import dataclasses
import functools

from xlaopt.analysis.analytic import _BF16_BYTES, DecoderShape


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


@dataclasses.dataclass(frozen=True)
class ConvShape(DecoderShape):
    """`layers` convolutions; `d_model` their mean output elements an image (what one layer's
    activation holds, as a transformer's d_model does a token's); no attention."""
    conv_params: int = 0
    conv_flops: float = 0.0  # forward, an image, all convolutions
    head_in: int = 0  # the pooled features the classifier reads

    def __post_init__(self):
        pass  # no heads to divide

    @functools.cached_property
    def layer_params(self) -> int:
        return self.conv_params // self.layers

    @property
    def embedding_params(self) -> int:
        return self.head_in * self.vocab

    def linear_forward_flops(self, tokens: float) -> float:
        return tokens * self.conv_flops / self.layers

    def attention_forward_flops(self, sequences: float, seq_len: int) -> float:
        return 0.0

    def head_forward_flops(self, tokens: float) -> float:
        return 2.0 * tokens * self.head_in * self.vocab

    def elementwise_forward_bytes_per_token(self, fused: bool) -> float:
        # Batch norm (its statistics, then the normalisation fused with the ReLU and any residual
        # add): the output read twice and written once, in bf16.
        return 3 * _BF16_BYTES * self.d_model


def conv_shape(config) -> ConvShape:
    from xlaopt.models.resnet import blocks, forward_flops, stem_conv

    convs = [stem_conv(config)] + [c for _, main, short in blocks(config) for c in main + ([short] if short else [])]
    head_in = config.features
    return ConvShape(layers=len(convs), d_model=sum(c.out_size**2 * c.c_out for c in convs) // len(convs), heads=1,
                     kv_heads=1, ffn=0, vocab=config.num_classes, mlp="gelu", kv_channels=1,
                     conv_params=sum(c.kernel**2 * c.c_in * c.c_out for c in convs),
                     conv_flops=forward_flops(config) - 2.0 * head_in * config.num_classes, head_in=head_in)


def _tower_fields(config) -> dict:
    mlp = "swiglu" if config.mlp_activation == "swiglu" else "gelu"  # relu2 and gelu: two matmuls
    return dict(layers=config.num_layers, d_model=config.d_model, heads=config.num_heads,
                kv_heads=config.num_kv_heads, ffn=config.mlp_dim, vocab=config.vocab_size, mlp=mlp,
                kv_channels=config.head_dim)


def tower_shape(config) -> DecoderShape:
    """One transformer tower of a registered config (a decoder, or one of Cosmos 3's two),
    for what does not depend on the rows: its layers' weights."""
    return DecoderShape(**_tower_fields(config))


def analytic_shape(config, pairs_executed_per_row: float | None = None, text_fraction: float = 1.0,
                   trainable: str = "all", text_attention_fraction: float = 0.0) -> DecoderShape:
    """The shape of a registered config. Cosmos 3 needs the priced rows' attention pairs; with
    `trainable="generator"` (its reasoner frozen) also the reasoner queries' share of them."""
    from xlaopt.families import family_of

    family = family_of(config)
    if trainable not in family.trainable_names:
        raise ValueError(f"trainable={trainable!r}: the {family.name} family's sets are {family.trainable_names}")
    if not family.has_layer_stack:
        return conv_shape(config)
    common = _tower_fields(config)
    if family.generates_video:
        if pairs_executed_per_row is None:
            raise ValueError("a Cosmos 3 shape needs the attention pairs its rows execute")
        # The generator set (`xlaopt.models.cosmos3.GENERATOR_SET`) freezes the reasoner: one of
        # the two towers' weights, the text tokens' backward and its queries' attention, the
        # embedding and the LM head.
        frozen = {} if trainable == "all" else dict(frozen_layer_params=1.0 / family.towers,
                                                      frozen_tokens=text_fraction,
                                                      frozen_attention=text_attention_fraction, frozen_head=True)
        return MoTShape(**common, towers=family.towers, attention_flops_per_row=4.0 * config.num_heads
                        * config.head_dim * pairs_executed_per_row, text_fraction=text_fraction, **frozen)
    if family.decodes_text:
        return DecoderShape(**common, tied_embeddings=config.tie_embeddings)
    # An image encoder: every token sees its whole image, the head on one pooled vector an image.
    T = config.tokens
    return MoTShape(**common, towers=family.towers, attention_flops_per_row=4.0 * config.num_heads * config.head_dim * T * T,
                    text_fraction=1.0 / T)

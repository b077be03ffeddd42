"""A decoder LLM's shape, as the analytic step price (`xlaopt.analysis.analytic`) reads it:
sizes, parameter counts, FLOPs and the bytes its elementwise work moves per token."""
from __future__ import annotations

import dataclasses
import functools

_BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """A decoder LLM's shape: the analytic twin of `xlaopt.models.decoder.DecoderConfig`
    (same FLOP count; a test checks it), without JAX."""
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str = "swiglu"  # "swiglu" (Llama) or "gelu" (GPT, MPT)
    tied_embeddings: bool = False
    kv_channels: int | None = None  # the head dimension where it is not d_model / heads (Qwen3-32B: 128, not 80)
    # Parameters a run freezes (`TrainSettings.trainable`): the share of each layer's weights, the
    # tokens and the attention FLOPs whose backward is dropped (nothing trained is upstream of
    # them), and whether the embedding and head are frozen. All zero: everything trains.
    frozen_layer_params: float = 0.0
    frozen_tokens: float = 0.0
    frozen_attention: float = 0.0
    frozen_head: bool = False

    def __post_init__(self):
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r}; use 'swiglu' or 'gelu'")
        if (self.kv_channels is None and self.d_model % self.heads) or self.heads % self.kv_heads:
            raise ValueError(f"d_model={self.d_model}, heads={self.heads}, kv_heads={self.kv_heads} do not divide")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.d_model // self.heads

    def layer_matmuls(self) -> tuple[int, ...]:
        """Weight sizes of a layer's linear layers, in call order: q, k, v, o, then the MLP
        (gate, up, down for SwiGLU; up, down for GELU)."""
        d, dh = self.d_model, self.head_dim
        attn = (d * self.heads * dh, d * self.kv_heads * dh, d * self.kv_heads * dh, self.heads * dh * d)
        mlp = (d * self.ffn,) * (3 if self.mlp == "swiglu" else 2)
        return attn + mlp

    @functools.cached_property
    def layer_params(self) -> int:
        return sum(self.layer_matmuls())  # norms are negligible

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    @property
    def trained_layer_params(self) -> float:
        return self.layer_params * (1.0 - self.frozen_layer_params)

    @property
    def trained_embedding_params(self) -> float:
        return 0.0 if self.frozen_head else self.embedding_params

    def linear_forward_flops(self, tokens: float) -> float:
        """One layer's linear matmuls, forward."""
        return 2.0 * tokens * self.layer_params

    def attention_forward_flops(self, sequences: float, seq_len: int) -> float:
        """One layer's causal attention (QK^T and PV, half the square), forward."""
        return 2.0 * sequences * self.heads * self.head_dim * seq_len**2

    def head_forward_flops(self, tokens: float) -> float:
        return 2.0 * tokens * self.d_model * self.vocab

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training model FLOPs per token: 3x forward, causal attention, no recomputation."""
        return 3.0 * (self.layers * (self.linear_forward_flops(1) + self.attention_forward_flops(1, seq_len) / seq_len)
                      + self.head_forward_flops(1))

    def elementwise_forward_bytes_per_token(self, fused: bool) -> float:
        """HBM traffic of one layer's non-matmul ops, forward, per token (bf16 activations): the
        residual stream's (`residual_stream_bytes_per_token`) and the rest.

        Fused (XLA, torch.compile, Transformer Engine): one pass per op group: rotary on q and k
        (read + write), the MLP activation (SwiGLU: read 2F write F; GELU: read F write F).
        Eager PyTorch: each op its own kernel: rotary through complex fp32 views ~20 bytes per
        element instead of 4, SwiGLU as silu then multiply (5F elements instead of 3F)."""
        qk = (self.heads + self.kv_heads) * self.head_dim
        act_fused = 3 if self.mlp == "swiglu" else 2
        rest = (_BF16_BYTES * (2 * qk + act_fused * self.ffn) if fused
                else 20 * qk + _BF16_BYTES * (act_fused + 2) * self.ffn)
        return self.residual_stream_bytes_per_token(fused) + rest

    def residual_stream_bytes_per_token(self, fused: bool) -> float:
        """The part of `elementwise_forward_bytes_per_token` on the residual stream (d wide): 2
        RMSNorms (read + write d) and 2 residual adds (read 2d, write d). Tensor parallelism
        splits it only with sequence parallelism; without, every tensor rank runs it whole.
        Eager PyTorch runs an RMSNorm as 6 kernels with an fp32 round trip (~36 bytes per element
        instead of 4)."""
        d = self.d_model
        return _BF16_BYTES * (2 * 2 * d + 2 * 3 * d) if fused else 2 * 36 * d + 2 * 3 * d * _BF16_BYTES

    def fp8_cast_bytes_per_token(self) -> float:
        """Casting a layer's linear inputs to fp8 forward (read 2 B, write 1 B) and its output
        gradients backward, plus the transposed fp8 copies the weight gradients need."""
        d, dh = self.d_model, self.head_dim
        inputs = d + self.heads * dh + d + self.ffn  # qkv, out, MLP up (and gate), MLP down
        outputs = (self.heads + 2 * self.kv_heads) * dh + d + (2 if self.mlp == "swiglu" else 1) * self.ffn + d
        return 3 * inputs + 3 * outputs + 2 * (inputs + outputs)

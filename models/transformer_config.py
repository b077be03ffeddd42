"""The shape fields every transformer config shares, validated once."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.models.registry import ConfigError


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    activations: ClassVar[tuple[str, ...]] = ("swiglu", "relu2", "gelu")
    name: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    head_dim: int | None = None  # default d_model / num_heads
    mlp_activation: str = "swiglu"
    rope_theta: float = 5e5
    norm_eps: float = 1e-5

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"{self.name}: {field}={getattr(self, field)} must be positive")
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ConfigError(
                    f"{self.name}: d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                    f"set head_dim explicitly or pick num_heads dividing {self.d_model}")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: head_dim={self.head_dim} must be even (rotary pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} "
                f"(grouped-query attention); pick num_kv_heads dividing {self.num_heads}")
        if self.mlp_activation not in self.activations:
            raise ConfigError(f"{self.name}: mlp_activation={self.mlp_activation!r}; use one of {self.activations}")

    def block_fields(self, dtype) -> dict:
        """The `TransformerBlock` fields every family's blocks share (each adds its own norms)."""
        return dict(d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, mlp_dim=self.mlp_dim, mlp_activation=self.mlp_activation,
                    norm_eps=self.norm_eps, dtype=dtype)

"""Cosmos 3 style model config, and its registered variants.

Derived fields (`head_dim`, `mrope_sections`) are `None` in a spec and resolved in
`__post_init__`, so an override of `d_model` re-derives them unless they are set too
(overrides start from the registered spec, see `xlaopt.models.registry`).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.models.registry import ConfigError, register
from xlaopt.models.transformer_config import TransformerConfig

# Released reasoners split 64 rotary frequencies as T:H:W = 24:20:20 (Qwen3-VL).
_RELEASED_MROPE = (24, 20, 20)


@dataclasses.dataclass(frozen=True)
class Cosmos3Config(TransformerConfig):
    family: ClassVar[str] = "cosmos3"
    activations: ClassVar[tuple[str, ...]] = ("swiglu", "relu2")  # Nano, Super / Edge
    mrope_sections: tuple[int, int, int] | None = None
    rope_theta: float = 5e6
    temporal_margin: int = 15000
    # mRoPE time of generator tokens (see `xlaopt.models.mrope`): with fps modulation a latent
    # step advances time by base rate / clip rate; without, by one.
    fps_modulation: bool = True
    base_fps: int = 24
    sound_latent_fps: float = 25.0
    norm_eps: float = 1e-6
    # Per-head QK RMSNorm in the reasoner (the generator always has it). The Edge variant drops
    # it and instead norms reasoner keys separately for the generator's queries only.
    reasoner_qk_norm: bool = True
    reasoner_key_norm_for_generator: bool = False
    # Inputs and outputs of the generator tower.
    latent_channels: int = 48  # Wan2.2 VAE
    patch_size: int = 2  # latent patches are patch_size x patch_size
    num_action_domains: int = 32
    action_dim: int = 64
    sound_dim: int = 64
    timestep_freq_dim: int = 256
    # Per-modality loss weights (text next-token, video/action/sound velocity).
    text_loss_weight: float = 1.0
    video_loss_weight: float = 1.0
    action_loss_weight: float = 10.0
    sound_loss_weight: float = 2.0

    def __post_init__(self):
        super().__post_init__()
        if self.mrope_sections is None:
            object.__setattr__(self, "mrope_sections", derive_mrope_sections(self.head_dim))
        sections = tuple(int(s) for s in self.mrope_sections)
        object.__setattr__(self, "mrope_sections", sections)
        if len(sections) != 3 or sum(sections) != self.head_dim // 2 or min(sections) < 0:
            raise ConfigError(
                f"{self.name}: mrope_sections={sections} must be three counts (T,H,W) summing to "
                f"head_dim/2={self.head_dim // 2}; e.g. {derive_mrope_sections(self.head_dim)}")
        if self.reasoner_key_norm_for_generator and self.reasoner_qk_norm:
            raise ConfigError(f"{self.name}: reasoner_key_norm_for_generator=True needs reasoner_qk_norm=False "
                              f"(the separate key norm replaces the reasoner's own, as in the Edge variant)")
        if sections[0] < max(sections[1], sections[2]):
            # Interleaving gives T every third frequency plus the tail; T must be the largest.
            raise ConfigError(f"{self.name}: mrope_sections={sections}: T must be >= H and W")

    @property
    def latent_patch_dim(self) -> int:
        """Channels of one patchified video latent token (48 x 2 x 2 = 192 for Wan2.2)."""
        return self.latent_channels * self.patch_size**2

    @property
    def generator_in_dim(self) -> int:
        """Width of the shared raw-input array for generator tokens (widest modality)."""
        return max(self.latent_patch_dim, self.action_dim, self.sound_dim)


def derive_mrope_sections(head_dim: int) -> tuple[int, int, int]:
    """Scale the released 24:20:20 split of 64 frequencies to head_dim/2 frequencies."""
    half = head_dim // 2
    hw = (half * _RELEASED_MROPE[1]) // sum(_RELEASED_MROPE)
    return (half - 2 * hw, hw, hw)


# Tiny: trains on a 2-core CPU in seconds per step; every size divides 8 so any
# 8-device mesh of data/fsdp/tensor fits.
register("cosmos3-tiny", Cosmos3Config, vocab_size=4096, d_model=256, num_layers=6, num_heads=8, num_kv_heads=4,
         mlp_dim=1024, rope_theta=1e4, num_action_domains=4, action_dim=16, sound_dim=16,
         latent_channels=8, timestep_freq_dim=64)
# Released sizes (reasoner Qwen3-VL-8B / -32B); built abstractly only.
register("cosmos3-nano", Cosmos3Config, vocab_size=151936, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8,
         mlp_dim=12288, head_dim=128, mrope_sections=_RELEASED_MROPE)
register("cosmos3-super", Cosmos3Config, vocab_size=151936, d_model=5120, num_layers=64, num_heads=64, num_kv_heads=8,
         mlp_dim=25600, head_dim=128, mrope_sections=_RELEASED_MROPE)

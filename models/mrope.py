"""Interleaved 3D multimodal RoPE (Qwen3-VL style), as Cosmos 3 uses it.

Positions are (t, h, w) triples per token. Rotary frequency i of the head_dim/2
frequencies rotates by the H position when i % 3 == 1 and i < 3*H, by the W position
when i % 3 == 2 and i < 3*W, and by the T position otherwise (so T owns i % 3 == 0
plus the tail). Rotation pairs are (i, i + head_dim/2) ("rotate half").

The host-side builders below say where each token of a sample sits:
  text tokens          (p, p, p), p = 0, 1, ... within the sample;
  video latent tokens  (t0 + t, h, w), t0 = n_text + margin, h and w restart at 0 per
                       video segment, tokens flattened time-major (t, then h, then w);
  action / sound       (t0 + t, 0, 0) on their own clock from the same offset.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

T_AXIS, H_AXIS, W_AXIS = 0, 1, 2


def frequency_axes(sections: tuple[int, int, int]) -> np.ndarray:
    """For each rotary frequency, which position axis (0=T, 1=H, 2=W) drives it."""
    t, h, w = sections
    idx = np.arange(t + h + w)
    axes = np.full(idx.shape, T_AXIS, np.int32)
    axes[(idx % 3 == 1) & (idx < 3 * h)] = H_AXIS
    axes[(idx % 3 == 2) & (idx < 3 * w)] = W_AXIS
    return axes


def rope_cos_sin(positions_3BL: jax.Array, head_dim: int, sections: tuple[int, int, int],
                 theta: float, inv_freq: tuple[float, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, L, head_dim] for (t, h, w) positions (ints or fp32), in fp32.

    The inverse frequencies are theta^(-2i/head_dim) rounded once to fp32, unless `inv_freq`
    gives them. Angles are fp32 products position x frequency, so at the generator's temporal
    offset (~15000) one ulp of a frequency moves an angle by ~1e-3 rad: matching another
    implementation bit for bit (torch's fp32 `pow` is not correctly rounded) needs its table.
    """
    half = head_dim // 2
    if inv_freq is None:
        inv_freq_F = 1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim))
    else:
        inv_freq_F = np.asarray(inv_freq, np.float32)
        if inv_freq_F.shape != (half,):
            raise ValueError(f"inv_freq has {inv_freq_F.shape[0]} frequencies; head_dim {head_dim} needs {half}")
    axes_F = frequency_axes(sections)
    # Pick, per frequency, the position along the axis that drives it.
    pos_BLF = jnp.take(positions_3BL.astype(jnp.float32), jnp.asarray(axes_F), axis=0)  # [F, B, L]
    angles_BLF = jnp.moveaxis(pos_BLF, 0, -1) * jnp.asarray(inv_freq_F, jnp.float32)
    angles_BLK = jnp.concatenate([angles_BLF, angles_BLF], axis=-1)
    return jnp.cos(angles_BLK), jnp.sin(angles_BLK)


def apply_rope(x_BLHK: jax.Array, cos_BLK: jax.Array, sin_BLK: jax.Array) -> jax.Array:
    half = x_BLHK.shape[-1] // 2
    x32 = x_BLHK.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos_BLK[:, :, None, :] + rotated * sin_BLK[:, :, None, :]
    return out.astype(x_BLHK.dtype)


# ---- host-side position builders (numpy), used by the data pipeline ----

def text_positions(n_text: int) -> np.ndarray:
    """(3, n_text) positions of a sample's text tokens."""
    p = np.arange(n_text, dtype=np.int32)
    return np.stack([p, p, p])


def temporal_offset(n_text: int, margin: int) -> int:
    """Temporal position of the first generator frame: after the text plus the margin."""
    return n_text + margin


def video_positions(t0: int, frames: int, height: int, width: int) -> np.ndarray:
    """(3, frames*height*width) positions of one video segment's latent patches, time-major."""
    t, h, w = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    return np.stack([t0 + t.ravel(), h.ravel(), w.ravel()]).astype(np.int32)


def clock_positions(t0: int, steps: int) -> np.ndarray:
    """(3, steps) positions of action or sound tokens: on a 1x1 grid from offset t0."""
    t = t0 + np.arange(steps, dtype=np.int32)
    z = np.zeros_like(t)
    return np.stack([t, z, z])

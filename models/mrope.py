"""Interleaved 3D multimodal RoPE (Qwen3-VL style), as Cosmos 3 uses it.

Positions are (t, h, w) triples per token. Rotary frequency i of the head_dim/2
frequencies rotates by the H position when i % 3 == 1 and i < 3*H, by the W position
when i % 3 == 2 and i < 3*W, and by the T position otherwise (so T owns i % 3 == 0
plus the tail). Rotation pairs are (i, i + head_dim/2) ("rotate half").

The host-side builders below say where each token of a sample sits:
  text tokens          (p, p, p), p = 0, 1, ... within the sample;
  video latent tokens  (t0 + t, h, w), t0 = n_text + margin, h and w restart at 0 per
                       video segment, tokens flattened time-major (t, then h, then w);
  action / sound       (t0 + t, 0, 0) from the same offset.
With fps modulation (Cosmos 3's default) t runs on a common clock: a latent step of a
clip advances t by (base rate / the clip's rate), so a 30 fps clip and a 24 fps clip of
the same duration span the same t; sound steps at its latent rate, actions at the video
frame rate starting one frame in. `xlaopt.data.packing.generator_positions` applies it.
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

VAE_TEMPORAL_COMPRESSION = 4  # Wan2.2: 4 video frames per latent frame


def text_positions(n_text: int) -> np.ndarray:
    """(3, n_text) positions of a sample's text tokens."""
    p = np.arange(n_text, dtype=np.int32)
    return np.stack([p, p, p])


def temporal_offset(n_text: int, margin: int) -> int:
    """Temporal position of the first generator step: after the text plus the margin."""
    return n_text + margin


def grid_positions(frames: int, height: int, width: int, t0: int, start: int = 0,
                   rate: tuple[float, float] | None = None) -> np.ndarray:
    """(3, frames*height*width) positions of a latent grid, time-major (t, then h, then w).

    Without `rate`, step f sits at t0 + start + f (int64). With `rate` = (steps per second of
    this clip, steps per second of one position unit) and more than one step, time is
    rescaled to the base clock and kept fractional (float32): t0 + (f + start) / rate[0] *
    rate[1], in that float32 operation order, as NVIDIA's pipeline computes it (so the ids
    match it bit for bit). A one-frame grid (an image) has no clock and keeps integer time.
    """
    spatial = height * width
    h = np.broadcast_to(np.arange(height)[None, :, None], (frames, height, width)).ravel()
    w = np.broadcast_to(np.arange(width)[None, None, :], (frames, height, width)).ravel()
    if rate is not None and frames > 1:
        steps_per_s, base_steps_per_s = np.float32(rate[0]), np.float32(rate[1])
        f = np.arange(frames, dtype=np.float32) + np.float32(start)
        t = (f / steps_per_s * base_steps_per_s + np.float32(t0)).astype(np.float32)
        return np.stack([np.repeat(t, spatial), h.astype(np.float32), w.astype(np.float32)])
    t = np.repeat(np.arange(frames, dtype=np.int64), spatial) + int(t0) + start
    return np.stack([t, h, w]).astype(np.int64)

"""Llama 3.1's rotary frequency scaling ("llama3" RoPE): longer context from a model trained on
`original_max_positions` tokens. Frequencies whose wavelength is shorter than
original / high_freq_factor stay; those longer than original / low_freq_factor are divided by
`factor`; the band between is interpolated smoothly."""
from __future__ import annotations

import math

import numpy as np


def llama3_inv_freq(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_positions: int) -> np.ndarray:
    """The scaled inverse frequencies (fp32) of the head_dim / 2 rotary pairs."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor,
                      np.where(wavelen < high_freq_wavelen, inv_freq, interpolated))
    return scaled.astype(np.float32)

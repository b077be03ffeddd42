"""Sample stores of real-size video latents, for measuring the read path where the disk, not
per-sample Python work, should set the pace.

The toy stores of `synthetic_store` hold ~1 KB samples, so reading them is bound by per-sample
overhead. A Cosmos 720p clip is 45 x 80 latent tokens per latent frame (1280x720 pixels, 8x
spatial VAE compression, 2x2 patches), ~12 latent frames: ~43k tokens of `latent_patch_dim`
(192 for cosmos3-nano) float32 channels, ~33 MB. Here every sample is such a clip, of a length
drawn between half and all of `tokens_per_clip`, so clip sizes mix as they do in real data and
the loader's packer has something to choose. The latents are random: nothing in the store
compresses, and nothing learnable is needed to measure reads.
"""
from __future__ import annotations

import math
import os

import numpy as np

from xlaopt.data.sample import Sample
from xlaopt.data.store import StoreWriter
from xlaopt.errors import UserError
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO

FRAME_GRID = (45, 80)  # latent tokens per latent frame of a 720p clip (height, width)
TOKENS_720P = 12 * FRAME_GRID[0] * FRAME_GRID[1]  # 43,200 tokens: ~33 MB at width 192
DEFAULT_SAMPLES = 96  # ~2.4 GB at the defaults: a cold read of a couple of seconds at ~1-2 GB/s
DEFAULT_CONFIG = "cosmos3-nano"


def clip_grid(tokens: int, rng: np.random.Generator) -> tuple[int, int, int]:
    """A (frames, height, width) latent grid of between half and all of `tokens` tokens."""
    h, w = FRAME_GRID if tokens >= FRAME_GRID[0] * FRAME_GRID[1] else (1, tokens)
    frames = max(1, tokens // (h * w))
    return int(rng.integers(math.ceil(frames / 2), frames + 1)), h, w


def video_samples(samples: int, tokens_per_clip: int, width: int, seed: int = 0):
    """`samples` text-to-video samples of `width`-channel latents, drawn lazily (seeded)."""
    rng = np.random.default_rng(seed)
    for _ in range(samples):
        grid = clip_grid(tokens_per_clip, rng)
        text = rng.integers(16, 1000, size=int(rng.integers(16, 64)), dtype=np.int32)
        latents = rng.standard_normal((int(np.prod(grid)), width), dtype=np.float32)
        yield Sample(text, VIDEO, latents, grid)


def make_video_store(directory: str | os.PathLike, samples: int = DEFAULT_SAMPLES,
                     tokens_per_clip: int = TOKENS_720P, config=None, seed: int = 0,
                     shard_bytes: int = 256 << 20) -> dict:
    """Write a store of `samples` video clips of up to `tokens_per_clip` latent tokens each, at
    the widths of `config` (a Cosmos3Config; default cosmos3-nano, whose loader reads it);
    returns the manifest. Sizes: samples x ~0.75 x tokens_per_clip x width x 4 bytes."""
    if samples < 1 or tokens_per_clip < 1:
        raise UserError(f"video store: need samples >= 1 and tokens_per_clip >= 1 "
                        f"(got {samples}, {tokens_per_clip})")
    if config is None:
        from xlaopt.models.registry import get_config
        config = get_config(DEFAULT_CONFIG)
    widths = {VIDEO: config.latent_patch_dim, ACTION: config.action_dim, SOUND: config.sound_dim}
    writer = StoreWriter(directory, widths, shard_bytes=shard_bytes)
    return writer.add_all(video_samples(samples, tokens_per_clip, widths[VIDEO], seed)).close()

"""Synthetic Cosmos-like samples and packed batches, generated locally and deterministically.

Samples mimic the real mix (captions, text-to-video, image-to-video with a clean first
frame, robot actions per embodiment, sound) at toy sizes, with structure a model can
learn: text follows a fixed sparse Markov chain whose first token is a class id, and
each class fixes the mean of its video latents, the phase of its action and sound
trajectories. So both the next-token loss and the velocity losses can fall.
"""
from __future__ import annotations

import numpy as np

from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.packing import fill_row, fits, logit_normal_sigma
from xlaopt.data.sample import Sample
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO
from xlaopt.models.cosmos3_config import Cosmos3Config

NUM_CLASSES = 16
SAMPLE_KINDS = ("caption", "text2video", "image2video", "action", "sound")
KIND_PROBS = (0.15, 0.3, 0.25, 0.2, 0.1)
VIDEO_GRIDS = ((1, 2, 2), (2, 2, 3), (2, 3, 4), (3, 4, 4))  # latent frames, height, width
MAX_MISSES = 4
RESOLUTION_SHIFT = 3.0  # sigma shift for the smallest (256p) resolution
FRAME_RATES = (24.0, 30.0)  # clips and robot logs come at either; the class picks (no extra draw)


class CosmosSamples:
    """Draws single synthetic samples for a model config; `world_seed` fixes what is learnable."""

    def __init__(self, config: Cosmos3Config, world_seed: int = 0):
        self.config = config
        world = np.random.default_rng(10_000 + world_seed)
        V, C = config.vocab_size, config.generator_in_dim
        self._successors = world.integers(NUM_CLASSES, V, size=(V, 2))
        self._video_mean = world.standard_normal((NUM_CLASSES, C)).astype(np.float32)
        self._phase = world.uniform(0, 2 * np.pi, size=(NUM_CLASSES, C)).astype(np.float32)

    def widths(self) -> dict[int, int]:
        c = self.config
        return {VIDEO: c.latent_patch_dim, ACTION: c.action_dim, SOUND: c.sound_dim}

    def draw(self, rng: np.random.Generator) -> Sample:
        c = self.config
        kind = SAMPLE_KINDS[rng.choice(len(SAMPLE_KINDS), p=KIND_PROBS)]
        cls = int(rng.integers(NUM_CLASSES))
        tokens = [cls]
        for _ in range(int(rng.integers(3, 12))):
            tokens.append(int(self._successors[tokens[-1], rng.integers(2)]))
        text = np.asarray(tokens, np.int32)
        if kind == "caption":
            return Sample(text)
        if kind in ("text2video", "image2video"):
            grid = VIDEO_GRIDS[rng.integers(len(VIDEO_GRIDS))]
            if kind == "image2video" and grid[0] == 1:
                grid = (2,) + grid[1:]
            n, width = int(np.prod(grid)), c.latent_patch_dim
            latents = self._video_mean[cls, :width] + 0.3 * rng.standard_normal((n, width))
            n_clean = grid[1] * grid[2] if kind == "image2video" else 0  # the first latent frame
            return Sample(text, VIDEO, latents.astype(np.float32), grid, 0, n_clean, FRAME_RATES[cls % 2])
        modality = ACTION if kind == "action" else SOUND
        n = int(rng.integers(4, 13))
        width = self.widths()[modality]
        steps = np.arange(n, dtype=np.float32)[:, None]
        latents = np.sin(0.5 * steps + self._phase[cls, :width]) + 0.1 * rng.standard_normal((n, width))
        domain = int(rng.integers(c.num_action_domains)) if modality == ACTION else 0
        fps = FRAME_RATES[cls % 2] if modality == ACTION else None  # sound runs at its latent rate
        return Sample(text, modality, latents.astype(np.float32), (n, 1, 1), domain, 0, fps)


class SyntheticCosmos:
    """An endless, seeded stream of packed batches: `batch(i)` is a pure function of (seed, i).
    Rows are packed greedily: a sample that does not fit is dropped, and a row closes after a
    few misses (the tensorstore loader packs stored samples properly)."""

    def __init__(self, config: Cosmos3Config, shape: BatchShape, seed: int = 0):
        self.config, self.shape, self.seed = config, shape, seed
        self.samples = CosmosSamples(config, seed)
        self._spec = cosmos3_batch_spec(config, shape)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        out = {k: np.zeros(s, d) for k, (s, d, _) in self._spec.items()}
        for row in range(self.shape.batch_size):
            chosen, misses = [], 0
            while misses < MAX_MISSES:
                sample = self.samples.draw(rng)
                if fits(chosen, sample, self.shape.text_len, self.shape.gen_len):
                    chosen.append(sample)
                else:
                    misses += 1
            fill_row(out, row, chosen, [logit_normal_sigma(rng, RESOLUTION_SHIFT) for _ in chosen], self.config)
        return out

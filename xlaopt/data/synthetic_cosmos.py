"""Synthetic Cosmos-like packed batches, generated locally and deterministically.

Samples mimic the real mix (captions, text-to-video, image-to-video with a clean first
frame, robot actions per embodiment, sound) at toy sizes, with structure a model can
learn: text follows a fixed sparse Markov chain whose first token is a class id, and
each class fixes the mean of its video latents, the phase of its action and sound
trajectories. So both the next-token loss and the velocity losses can fall.
"""
from __future__ import annotations

import numpy as np

from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.models import mrope
from xlaopt.models.cosmos3_config import Cosmos3Config
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO

NUM_CLASSES = 16
SAMPLE_KINDS = ("caption", "text2video", "image2video", "action", "sound")
KIND_PROBS = (0.15, 0.3, 0.25, 0.2, 0.1)
VIDEO_GRIDS = ((1, 2, 2), (2, 2, 3), (2, 3, 4), (3, 4, 4))  # latent frames, height, width
MAX_MISSES = 4
RESOLUTION_SHIFT = 3.0  # sigma shift for the smallest (256p) resolution


class SyntheticCosmos:
    """An endless, seeded stream of packed batches: `batch(i)` is a pure function of (seed, i)."""

    def __init__(self, config: Cosmos3Config, shape: BatchShape, seed: int = 0):
        self.config, self.shape, self.seed = config, shape, seed
        world = np.random.default_rng(10_000 + seed)
        V = config.vocab_size
        self._successors = world.integers(NUM_CLASSES, V, size=(V, 2))
        C = config.generator_in_dim
        self._video_mean = world.standard_normal((NUM_CLASSES, C)).astype(np.float32)
        self._phase = world.uniform(0, 2 * np.pi, size=(NUM_CLASSES, C)).astype(np.float32)
        self._spec = cosmos3_batch_spec(config, shape)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        out = {k: np.zeros(s, d) for k, (s, d, _) in self._spec.items()}
        for row in range(self.shape.batch_size):
            self._fill_row(rng, out, row)
        return out

    def _fill_row(self, rng, out, row):
        T, V = self.shape.text_len, self.shape.gen_len
        t_used = g_used = 0
        segment, misses = 0, 0
        while misses < MAX_MISSES:
            sample = self._sample(rng)
            n_text, n_gen = len(sample["tokens"]), len(sample["modality"])
            if t_used + n_text > T or g_used + n_gen > V:
                misses += 1  # drop it and try another; the row closes after a few misses
                continue
            segment += 1
            ts, gs = slice(t_used, t_used + n_text), slice(g_used, g_used + n_gen)
            out["text_tokens_BT"][row, ts] = sample["tokens"]
            out["text_segment_ids_BT"][row, ts] = segment
            out["text_positions_3BT"][:, row, ts] = mrope.text_positions(n_text)
            out["gen_segment_ids_BV"][row, gs] = segment
            out["gen_modality_BV"][row, gs] = sample["modality"]
            out["gen_action_domain_BV"][row, gs] = sample["domain"]
            out["gen_noisy_BV"][row, gs] = sample["noisy"]
            out["gen_sigma_BV"][row, gs] = sample["sigma"]
            out["gen_x0_BVC"][row, gs] = sample["x0"]
            if n_gen:
                t0 = mrope.temporal_offset(n_text, self.config.temporal_margin)
                out["gen_positions_3BV"][:, row, gs] = (
                    mrope.video_positions(t0, *sample["grid"]) if sample["modality"][0] == VIDEO
                    else mrope.clock_positions(t0, n_gen))
            t_used, g_used = t_used + n_text, g_used + n_gen
        # Padding (segment 0) gets positions counting on, as a trailing causal split would.
        out["text_positions_3BT"][:, row, t_used:] = np.arange(T - t_used)
        out["gen_positions_3BV"][:, row, g_used:] = np.arange(V - g_used)

    def _sample(self, rng) -> dict:
        c = self.config
        kind = SAMPLE_KINDS[rng.choice(len(SAMPLE_KINDS), p=KIND_PROBS)]
        cls = int(rng.integers(NUM_CLASSES))
        tokens = [cls]
        for _ in range(int(rng.integers(3, 12))):
            tokens.append(self._successors[tokens[-1], rng.integers(2)])
        u = 1.0 / (1.0 + np.exp(-rng.standard_normal()))
        sigma = RESOLUTION_SHIFT * u / (1.0 + (RESOLUTION_SHIFT - 1.0) * u)
        C = c.generator_in_dim
        grid, domain = None, 0
        if kind == "caption":
            n, modality = 0, VIDEO
        elif kind in ("text2video", "image2video"):
            grid = VIDEO_GRIDS[rng.integers(len(VIDEO_GRIDS))]
            if kind == "image2video" and grid[0] == 1:
                grid = (2,) + grid[1:]
            n, modality = int(np.prod(grid)), VIDEO
        else:
            n, modality = int(rng.integers(4, 13)), ACTION if kind == "action" else SOUND
            domain = int(rng.integers(c.num_action_domains)) if kind == "action" else 0

        if modality == VIDEO:
            x0 = self._video_mean[cls] + 0.3 * rng.standard_normal((n, C))
        else:
            steps = np.arange(n, dtype=np.float32)[:, None]
            x0 = np.sin(0.5 * steps + self._phase[cls]) + 0.1 * rng.standard_normal((n, C))
        width = {VIDEO: c.latent_patch_dim, ACTION: c.action_dim, SOUND: c.sound_dim}[modality]
        x0[:, width:] = 0.0
        noisy = np.ones(n, bool)
        if kind == "image2video":
            noisy[: grid[1] * grid[2]] = False  # the first latent frame is clean conditioning
        return dict(tokens=np.asarray(tokens, np.int32), modality=np.full(n, modality, np.int32),
                    domain=np.full(n, domain, np.int32), noisy=noisy, sigma=np.float32(sigma),
                    x0=x0.astype(np.float32), grid=grid)

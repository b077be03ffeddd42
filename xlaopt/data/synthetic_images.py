"""Synthetic labelled images: each class a fixed random pattern, each image its class's pattern
under noise of the same size, so a classifier's loss can fall within a few steps."""
from __future__ import annotations

from typing import Callable

import numpy as np

from xlaopt.data.batch import BatchShape


class SyntheticImages:
    """`batch(i)` is a pure function of (seed, i). `batch_spec`: the family's, whose `images_BHWC`
    and `labels_B` are filled; any other array of it is the per-image (or per-token) real marker,
    all ones (no padding rows)."""

    def __init__(self, config, shape: BatchShape, seed: int = 0, *, batch_spec: Callable):
        spec = batch_spec(config, shape)
        self.shape, self.seed, self._spec = shape, seed, spec
        _, H, W, C = spec["images_BHWC"][0]
        self._patterns_EHWC = np.random.default_rng(30_000 + seed).standard_normal(
            (config.num_classes, H, W, C)).astype(np.float32)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        labels_B = rng.integers(0, self._patterns_EHWC.shape[0], self.shape.batch_size).astype(np.int32)
        noise = rng.standard_normal(self._spec["images_BHWC"][0]).astype(np.float32)
        out = {k: np.ones(s, d) for k, (s, d, _) in self._spec.items()}
        out.update(images_BHWC=self._patterns_EHWC[labels_B] + noise, labels_B=labels_B)
        return out

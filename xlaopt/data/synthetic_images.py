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
        self.num_classes = config.num_classes
        self._patterns: dict[int, np.ndarray] = {}

    def pattern(self, label: int) -> np.ndarray:
        """Class `label`'s pattern [H, W, C], drawn when first needed: all of ImageNet's 1,000 at
        224 x 224 up front were 600 MB and 15 s for a one-image batch."""
        if label not in self._patterns:
            _, H, W, C = self._spec["images_BHWC"][0]
            rng = np.random.default_rng([30_000 + self.seed, label])
            self._patterns[label] = rng.standard_normal((H, W, C)).astype(np.float32)
        return self._patterns[label]

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        labels_B = rng.integers(0, self.num_classes, self.shape.batch_size).astype(np.int32)
        noise = rng.standard_normal(self._spec["images_BHWC"][0]).astype(np.float32)
        out = {k: np.ones(s, d) for k, (s, d, _) in self._spec.items()}
        out.update(images_BHWC=np.stack([self.pattern(int(c)) for c in labels_B]) + noise, labels_B=labels_B)
        return out

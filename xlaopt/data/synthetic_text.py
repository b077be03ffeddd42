"""Synthetic packed text for decoder LLMs: documents from a fixed sparse Markov chain (two
likely successors per token), packed into rows, so next-token loss can fall quickly."""
from __future__ import annotations

import numpy as np

from xlaopt.data.batch import BatchShape, decoder_batch_spec
from xlaopt.models.decoder import DecoderConfig


class SyntheticText:
    """`batch(i)` is a pure function of (seed, i)."""

    def __init__(self, config: DecoderConfig, shape: BatchShape, seed: int = 0):
        self.shape, self.seed = shape, seed
        self._successors = np.random.default_rng(20_000 + seed).integers(0, config.vocab_size, (config.vocab_size, 2))
        self._spec = decoder_batch_spec(config, shape)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        out = {k: np.zeros(s, d) for k, (s, d, _) in self._spec.items()}
        T = self.shape.text_len
        for row in range(self.shape.batch_size):
            used, segment = 0, 0
            while used < T:
                n = min(int(rng.integers(T // 8 + 2, T // 2 + 3)), T - used)
                if n < 2:
                    break  # leave the tail as padding
                segment += 1
                doc = [int(rng.integers(self._successors.shape[0]))]
                for _ in range(n - 1):
                    doc.append(int(self._successors[doc[-1], rng.integers(2)]))
                out["tokens_BT"][row, used:used + n] = doc
                out["segment_ids_BT"][row, used:used + n] = segment
                out["positions_BT"][row, used:used + n] = np.arange(n)
                used += n
        return out

"""Write samples into a packed Cosmos 3 row: tokens, segment ids, mRoPE positions, modality,
noise masks and flow sigmas, exactly as `cosmos3_batch_spec` describes."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from xlaopt.data.sample import Sample
from xlaopt.models import mrope
from xlaopt.models.cosmos3 import VIDEO
from xlaopt.models.cosmos3_config import Cosmos3Config


def logit_normal_sigma(rng: np.random.Generator, shift: float) -> float:
    """sigma = s*t / (1 + (s-1)*t) with t = sigmoid(N(0, 1)) (rectified flow, resolution shift s)."""
    t = 1.0 / (1.0 + np.exp(-rng.standard_normal()))
    return float(shift * t / (1.0 + (shift - 1.0) * t))


def fits(samples: Sequence[Sample], sample: Sample, text_len: int, gen_len: int) -> bool:
    return (sum(s.n_text for s in samples) + sample.n_text <= text_len
            and sum(s.n_gen for s in samples) + sample.n_gen <= gen_len)


def fill_row(out: dict[str, np.ndarray], row: int, samples: Sequence[Sample], sigmas: Sequence[float],
             config: Cosmos3Config) -> None:
    """Pack `samples` (with their flow sigmas) into row `row` of a zeroed batch `out`."""
    T, V = out["text_tokens_BT"].shape[1], out["gen_segment_ids_BV"].shape[1]
    t_used = g_used = 0
    for segment, (sample, sigma) in enumerate(zip(samples, sigmas), start=1):
        n_text, n_gen = sample.n_text, sample.n_gen
        ts, gs = slice(t_used, t_used + n_text), slice(g_used, g_used + n_gen)
        out["text_tokens_BT"][row, ts] = sample.text
        out["text_segment_ids_BT"][row, ts] = segment
        out["text_positions_3BT"][:, row, ts] = mrope.text_positions(n_text)
        if n_gen:
            out["gen_segment_ids_BV"][row, gs] = segment
            out["gen_modality_BV"][row, gs] = sample.modality
            out["gen_action_domain_BV"][row, gs] = sample.domain
            out["gen_noisy_BV"][row, gs] = np.arange(n_gen) >= sample.n_clean
            out["gen_sigma_BV"][row, gs] = sigma
            out["gen_x0_BVC"][row, gs, : sample.latents.shape[1]] = sample.latents
            t0 = mrope.temporal_offset(n_text, config.temporal_margin)
            out["gen_positions_3BV"][:, row, gs] = (mrope.video_positions(t0, *sample.grid)
                                                    if sample.modality == VIDEO else mrope.clock_positions(t0, n_gen))
        t_used, g_used = t_used + n_text, g_used + n_gen
    # Padding (segment 0) gets positions counting on, as a trailing causal split would.
    out["text_positions_3BT"][:, row, t_used:] = np.arange(T - t_used)
    out["gen_positions_3BV"][:, row, g_used:] = np.arange(V - g_used)

"""Write samples into a packed Cosmos 3 row: tokens, segment ids, mRoPE positions, modality,
noise masks and flow sigmas, exactly as `cosmos3_batch_spec` describes."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from xlaopt.data.sample import Sample
from xlaopt.models import mrope
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO
from xlaopt.models.cosmos3_config import Cosmos3Config


def logit_normal_sigma(rng: np.random.Generator, shift: float) -> float:
    """sigma = s*t / (1 + (s-1)*t) with t = sigmoid(N(0, 1)) (rectified flow, resolution shift s)."""
    t = 1.0 / (1.0 + np.exp(-rng.standard_normal()))
    return float(shift * t / (1.0 + (shift - 1.0) * t))


def fits(samples: Sequence[Sample], sample: Sample, text_len: int, gen_len: int) -> bool:
    return (sum(s.n_text for s in samples) + sample.n_text <= text_len
            and sum(s.n_gen for s in samples) + sample.n_gen <= gen_len)


def generator_positions(modality: int, grid: tuple[int, int, int], t0: int, fps: float | None,
                        config: Cosmos3Config) -> np.ndarray:
    """(3, n) mRoPE positions of one generator split, as NVIDIA's pipeline builds them: video
    latent frames at fps / 4 per second, sound at its latent rate, actions at the video frame
    rate one frame in; with fps modulation each clock is rescaled to base_fps / 4 (one position
    per latent frame of a base-rate video). `fps` None: the clip runs at the base rate."""
    fps = fps or config.base_fps
    k = mrope.VAE_TEMPORAL_COMPRESSION
    start, rate = {VIDEO: (0, (fps / k, config.base_fps / k)),
                   SOUND: (0, (config.sound_latent_fps, config.base_fps)),
                   ACTION: (1, (fps, config.base_fps / k))}[modality]
    return mrope.grid_positions(*grid, t0, start, rate if config.fps_modulation else None)


def sample_fields(sample: Sample, sigma: float, config: Cosmos3Config) -> dict[str, np.ndarray]:
    """One sample's per-token fields as they sit in a packed row, segment ids and latents aside:
    text tokens and (3, n_text) mRoPE positions; generator (3, n_gen) positions, modality,
    action domain, noise mask and flow sigma."""
    n_text, n_gen = sample.n_text, sample.n_gen
    t0 = mrope.temporal_offset(n_text, config.temporal_margin)
    return {
        "text_tokens": np.asarray(sample.text, np.int32),
        "text_positions": mrope.text_positions(n_text),
        "gen_positions": (generator_positions(sample.modality, sample.grid, t0, sample.fps, config).astype(np.float32)
                          if n_gen else np.zeros((3, 0), np.float32)),
        "gen_modality": np.full(n_gen, sample.modality, np.int32),
        "gen_action_domain": np.full(n_gen, sample.domain, np.int32),
        "gen_noisy": np.arange(n_gen) >= sample.n_clean,
        "gen_sigma": np.full(n_gen, sigma, np.float32),
    }


def sample_arrays(sample: Sample, sigma: float, config: Cosmos3Config) -> dict[str, np.ndarray]:
    """`sample_fields` plus the latents widened to the generator's input width (`gen_x0`):
    everything a packer that concatenates per-token arrays needs (Grain's, in the benchmark)."""
    x0 = np.zeros((sample.n_gen, config.generator_in_dim), np.float32)
    if sample.n_gen:
        x0[:, : sample.latents.shape[1]] = sample.latents
    return sample_fields(sample, sigma, config) | {"gen_x0": x0}


def fill_row(out: dict[str, np.ndarray], row: int, samples: Sequence[Sample], sigmas: Sequence[float],
             config: Cosmos3Config, latents_placed: bool = False) -> None:
    """Pack `samples` (with their flow sigmas) into row `row` of a batch `out`, whose arrays are
    zeroed except `gen_x0_BVC`: that one this row writes whole (latents, zeros beyond a sample's
    width and in the padding), so it may come uninitialised, e.g. from a buffer pool.
    `latents_placed`: each sample's latents already are its slice of `gen_x0_BVC` (read there
    by `SampleStore.start_many`), so multi-MB clips are not copied again."""
    t_used = g_used = 0
    x0 = out["gen_x0_BVC"]
    for segment, (sample, sigma) in enumerate(zip(samples, sigmas), start=1):
        a = sample_fields(sample, sigma, config)
        ts, gs = slice(t_used, t_used + sample.n_text), slice(g_used, g_used + sample.n_gen)
        out["text_tokens_BT"][row, ts] = a["text_tokens"]
        out["text_segment_ids_BT"][row, ts] = segment
        out["text_positions_3BT"][:, row, ts] = a["text_positions"]
        out["gen_segment_ids_BV"][row, gs] = segment
        out["gen_positions_3BV"][:, row, gs] = a["gen_positions"]
        if sample.n_gen:
            width = sample.latents.shape[1]
            if not latents_placed:
                x0[row, gs, :width] = sample.latents
            elif sample.latents.ctypes.data != x0[row, gs].ctypes.data:
                raise ValueError(f"row {row}: a sample's latents are not at generator tokens {gs.start}.. of "
                                 f"the batch, where they were to be read")
            x0[row, gs, width:] = 0
        for name in ("gen_modality", "gen_action_domain", "gen_noisy", "gen_sigma"):
            out[f"{name}_BV"][row, gs] = a[name]
        t_used, g_used = ts.stop, gs.stop
    x0[row, g_used:] = 0
    # Padding (segment 0) gets positions counting on, as a trailing causal split would.
    T, V = out["text_tokens_BT"].shape[1], out["gen_segment_ids_BV"].shape[1]
    out["text_positions_3BT"][:, row, t_used:] = np.arange(T - t_used)
    out["gen_positions_3BV"][:, row, g_used:] = np.arange(V - g_used)

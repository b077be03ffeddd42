"""xlaopt's Cosmos 3 called as the reference's `Cosmos3OmniTransformer.forward` is called.

The reference takes one sample as a joint sequence: a causal text prefix of `und_len`
tokens, then generator tokens (patchified video latents, sound, actions) at given sequence
indexes, per-token timesteps for the noisy ones, and `[3, sequence_length]` mRoPE position
ids. `sample_to_batch` writes that sample into one packed xlaopt row (reasoner region =
the prefix, generator region = the rest, one segment); `forward` runs xlaopt's model and
reads predictions back out in the reference's layout: per item, vision `[1, C, T, H, W]`
(zeros at conditioning frames), sound `[C, T]`, action `[T, A]`.

`reference_positions` and `make_sample` build a sample as NVIDIA's pipeline does
(`diffusers/pipelines/cosmos/pipeline_cosmos3_omni.py`, `_prepare_*_segment`), in numpy.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.data.packing import generator_positions
from xlaopt.errors import UserError
from xlaopt.interop.diffusers_config import ReferenceSettings
from xlaopt.models import mrope
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO, Cosmos3
from xlaopt.models.cosmos3_config import Cosmos3Config

LIST_KWARGS = ("vision_tokens", "vision_token_shapes", "vision_noisy_frame_indexes", "sound_tokens",
               "sound_token_shapes", "sound_noisy_frame_indexes", "action_tokens", "action_token_shapes",
               "action_noisy_frame_indexes", "action_domain_ids")
INT_KWARGS = ("und_len", "sequence_length")
ARRAY_KWARGS = ("input_ids", "text_indexes", "position_ids", "vision_sequence_indexes", "vision_mse_loss_indexes",
                "vision_timesteps", "sound_sequence_indexes", "sound_mse_loss_indexes", "sound_timesteps",
                "action_sequence_indexes", "action_mse_loss_indexes", "action_timesteps")


class ReferenceSampleError(UserError):
    """A reference-style sample xlaopt's packed row cannot hold, or an unreadable sample file."""


# ---- the sample file: the reference forward's keyword arguments, by name -----------------

def save_sample(path, kwargs: dict) -> None:
    """Lists as name_0, name_1, ...; ints as 0-d arrays; None omitted."""
    out = {}
    for k, v in kwargs.items():
        if v is None:
            continue
        if k in LIST_KWARGS:
            for i, item in enumerate(v):
                out[f"{k}_{i}"] = np.asarray(item)
        else:
            out[k] = np.asarray(v)
    np.savez(path, **out)


def load_sample(path) -> dict:
    try:
        data = dict(np.load(path, allow_pickle=False))
    except (OSError, ValueError) as e:
        raise ReferenceSampleError(f"{path}: not a sample .npz: {e}") from e
    out: dict = {}
    for k in LIST_KWARGS:
        items = []
        while f"{k}_{len(items)}" in data:
            items.append(data.pop(f"{k}_{len(items)}"))
        if items:
            out[k] = [tuple(int(x) for x in a) if k.endswith("_shapes") else a for a in items]
    for k in INT_KWARGS:
        if k in data:
            out[k] = int(data.pop(k))
    for k in ARRAY_KWARGS:
        if k in data:
            out[k] = data.pop(k)
    if data:
        raise ReferenceSampleError(f"{path}: unknown entries {sorted(data)} (expected the reference forward's "
                          f"keyword arguments: {', '.join(INT_KWARGS + ARRAY_KWARGS + LIST_KWARGS)})")
    missing = [k for k in ("input_ids", "text_indexes", "position_ids", "und_len", "sequence_length",
                           "vision_tokens", "vision_token_shapes", "vision_sequence_indexes",
                           "vision_mse_loss_indexes", "vision_timesteps", "vision_noisy_frame_indexes")
               if k not in out]
    if missing:
        raise ReferenceSampleError(f"{path}: missing required arguments {missing}")
    return out


# ---- positions and samples, as the reference pipeline builds them ----------------------

def reference_positions(config: Cosmos3Config, n_text: int, video_grid: tuple[int, int, int] | None = None,
                        n_sound: int = 0, n_action: int = 0, fps: float = 24.0) -> np.ndarray:
    """[3, S] position ids of [text | video | sound | action] as the reference pipeline builds
    them: text from 0, every generator modality from the same temporal offset (text length +
    margin), each on its clock (`xlaopt.data.packing.generator_positions`, the packer's rule).
    Like the pipeline's, the ids are float32 with fps modulation and int64 without."""
    t0 = mrope.temporal_offset(n_text, config.temporal_margin)
    parts = [mrope.text_positions(n_text)]
    for modality, grid in ((VIDEO, video_grid), (SOUND, (n_sound, 1, 1) if n_sound else None),
                           (ACTION, (n_action, 1, 1) if n_action else None)):
        if grid is not None:
            parts.append(generator_positions(modality, grid, t0, fps, config))
    dtype = np.float32 if config.fps_modulation else np.int64
    return np.concatenate([p.astype(dtype) for p in parts], axis=1)


def make_sample(config: Cosmos3Config, settings: ReferenceSettings, seed: int, n_text: int = 7,
                latent_grid: tuple[int, int, int] = (3, 3, 4), n_sound: int = 5, n_action: int = 4,
                condition_frames: tuple[int, ...] = (0,), fps: float = 24.0) -> dict:
    """One image-to-video style sample covering every modality the config has, as the
    reference forward's keyword arguments (numpy): random text, a latent video [1, C, T, H, W]
    whose `condition_frames` are clean, sound (all noisy), actions (first step clean) with a
    random embodiment, and random per-token timesteps in (0, 1000)."""
    rng = np.random.default_rng(seed)
    c, p = config, config.patch_size
    lt, lh, lw = latent_grid
    ph, pw = math.ceil(lh / p), math.ceil(lw / p)
    n_vis = lt * ph * pw
    n_sound = n_sound if settings.sound_gen else 0
    n_action = n_action if settings.action_gen else 0
    und = n_text
    seq = und + n_vis + n_sound + n_action
    noisy_frames = np.array([t for t in range(lt) if t not in condition_frames], np.int64)
    vis_start = und
    vis_mse = np.concatenate([np.arange(vis_start + f * ph * pw, vis_start + (f + 1) * ph * pw) for f in noisy_frames]
                             ) if len(noisy_frames) else np.zeros(0, np.int64)
    ts = lambda n: (rng.uniform(0.05, 0.95, n) * 1000).astype(np.float32)
    kw = dict(
        input_ids=rng.integers(0, c.vocab_size, n_text).astype(np.int64),
        text_indexes=np.arange(und, dtype=np.int64),
        position_ids=reference_positions(c, n_text, (lt, ph, pw), n_sound, n_action, fps),
        und_len=und, sequence_length=seq,
        vision_tokens=[rng.standard_normal((1, c.latent_channels, lt, lh, lw)).astype(np.float32)],
        vision_token_shapes=[(lt, ph, pw)],
        vision_sequence_indexes=np.arange(vis_start, vis_start + n_vis, dtype=np.int64),
        vision_mse_loss_indexes=vis_mse.astype(np.int64),
        vision_timesteps=ts(len(vis_mse)),
        vision_noisy_frame_indexes=[noisy_frames],
    )
    start = vis_start + n_vis
    if n_sound:
        idx = np.arange(start, start + n_sound, dtype=np.int64)
        kw.update(sound_tokens=[rng.standard_normal((c.sound_dim, n_sound)).astype(np.float32)],
                  sound_token_shapes=[(n_sound, 1, 1)], sound_sequence_indexes=idx, sound_mse_loss_indexes=idx.copy(),
                  sound_timesteps=ts(n_sound), sound_noisy_frame_indexes=[np.arange(n_sound, dtype=np.int64)])
        start += n_sound
    if n_action:
        idx = np.arange(start, start + n_action, dtype=np.int64)
        noisy = np.arange(1, n_action, dtype=np.int64)
        kw.update(action_tokens=[rng.standard_normal((n_action, c.action_dim)).astype(np.float32)],
                  action_token_shapes=[(n_action, 1, 1)], action_sequence_indexes=idx,
                  action_mse_loss_indexes=idx[noisy], action_timesteps=ts(len(noisy)),
                  action_noisy_frame_indexes=[noisy],
                  action_domain_ids=[np.asarray(rng.integers(c.num_action_domains), np.int64)])
    return kw


# ---- the sample as one packed xlaopt row -----------------------------------------------------

def patchify(latent: np.ndarray, p: int) -> np.ndarray:
    """[1, C, T, H, W] -> [T*h*w, p*p*C] patches (H, W zero-padded to multiples of p), the
    reference's (t, h, w) token order and (p, q, c) channel order."""
    lat = np.asarray(latent)[0]
    C, T, H, W = lat.shape
    Hp, Wp = -(-H // p) * p, -(-W // p) * p
    if (Hp, Wp) != (H, W):
        lat = np.pad(lat, ((0, 0), (0, 0), (0, Hp - H), (0, Wp - W)))
    lat = lat.reshape(C, T, Hp // p, p, Wp // p, p)
    return np.einsum("cthpwq->thwpqc", lat).reshape(-1, p * p * C)


def unpatchify(patches: np.ndarray, frames: np.ndarray, shape: tuple[int, int, int, int], p: int) -> np.ndarray:
    """Predicted patches of the noisy `frames` -> [1, C, T, H, W], zeros at other frames."""
    C, T, H, W = shape
    hp, wp = -(-H // p), -(-W // p)
    out = np.zeros((C, T, H, W), np.float32)
    if len(frames):
        lat = patches.reshape(len(frames), hp, wp, p, p, C)
        lat = np.einsum("thwpqc->cthpwq", lat).reshape(C, len(frames), hp * p, wp * p)
        out[:, frames] = lat[:, :, :H, :W]
    return out[None]


def _noisy_rows(noisy_frame_indexes, token_shapes) -> np.ndarray:
    """Rows of a modality's packed tokens that are noisy, in the order the reference assigns
    timestep embeddings to them (item by item, frame by frame, spatially within a frame)."""
    rows, start = [], 0
    for frames, shape in zip(noisy_frame_indexes, token_shapes):
        spatial = math.prod(shape[1:])
        frames = np.asarray(frames, np.int64)
        rows.append((frames[:, None] * spatial + np.arange(spatial) + start).ravel())
        start += shape[0] * spatial
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)


def sample_to_batch(kw: dict, config: Cosmos3Config, settings: ReferenceSettings) -> tuple[dict, np.ndarray]:
    """(a batch of one packed row, the generator's inputs [1, V, C]) for a reference sample."""
    c = config
    T, S = int(kw["und_len"]), int(kw["sequence_length"])
    V = S - T
    P, C = c.latent_patch_dim, c.generator_in_dim
    if T < 1 or V < 1:
        raise ReferenceSampleError(f"und_len={T}, sequence_length={S}: need a text prefix and generator tokens")
    text_idx = np.asarray(kw["text_indexes"], np.int64)
    if sorted(text_idx.tolist()) != list(range(T)):
        raise ReferenceSampleError("text_indexes must cover exactly the causal prefix [0, und_len): xlaopt's reasoner "
                          "region holds text tokens only")
    pos = np.asarray(kw["position_ids"])
    if pos.shape != (3, S):
        raise ReferenceSampleError(f"position_ids has shape {pos.shape}; expected (3, {S})")
    pos_dtype = np.float32 if np.issubdtype(pos.dtype, np.floating) else np.int32
    tokens = np.zeros((1, T), np.int32)
    tokens[0, text_idx] = np.asarray(kw["input_ids"])
    batch = {
        "text_tokens_BT": tokens, "text_segment_ids_BT": np.ones((1, T), np.int32),
        "text_positions_3BT": pos[:, None, :T].astype(pos_dtype),
        "gen_segment_ids_BV": np.ones((1, V), np.int32), "gen_positions_3BV": pos[:, None, T:].astype(pos_dtype),
        "gen_modality_BV": np.zeros((1, V), np.int32), "gen_action_domain_BV": np.zeros((1, V), np.int32),
        "gen_noisy_BV": np.zeros((1, V), bool), "gen_sigma_BV": np.zeros((1, V), np.float32),
    }
    x = np.zeros((1, V, C), np.float32)
    scale = np.float32(settings.timestep_scale)
    used = np.zeros(V, bool)

    def place(name, modality, packed, seq_idx, noisy_frames, shapes, timesteps, domains=None):
        rows = np.asarray(seq_idx, np.int64) - T
        if len(rows) != len(packed) or (len(rows) and (rows.min() < 0 or rows.max() >= V)):
            raise ReferenceSampleError(f"{name}_sequence_indexes: {len(rows)} indexes for {len(packed)} tokens, all in "
                              f"[und_len, sequence_length) = [{T}, {S})")
        if used[rows].any() or len(set(rows.tolist())) != len(rows):
            raise ReferenceSampleError(f"{name}_sequence_indexes overlap another modality's or repeat")
        used[rows] = True
        x[0, rows, : packed.shape[1]] = packed
        batch["gen_modality_BV"][0, rows] = modality
        if domains is not None:
            batch["gen_action_domain_BV"][0, rows] = domains
        if timesteps is not None:
            noisy = rows[_noisy_rows(noisy_frames, shapes)]
            t = np.asarray(timesteps, np.float32)
            if len(t) < len(noisy):
                raise ReferenceSampleError(f"{name}_timesteps: {len(t)} values for {len(noisy)} noisy tokens")
            batch["gen_noisy_BV"][0, noisy] = True
            batch["gen_sigma_BV"][0, noisy] = t[: len(noisy)] * scale

    vision = np.concatenate([patchify(v, c.patch_size) for v in kw["vision_tokens"]])
    if vision.shape[1] != P:
        raise ReferenceSampleError(f"vision_tokens: {vision.shape[1]} channels per patch, the model takes {P}")
    place("vision", VIDEO, vision, kw["vision_sequence_indexes"], kw["vision_noisy_frame_indexes"],
          kw["vision_token_shapes"], kw["vision_timesteps"])
    if kw.get("sound_tokens") is not None and kw.get("sound_sequence_indexes") is not None:
        if not settings.sound_gen:
            raise ReferenceSampleError("the sample has sound but the model has no sound head (sound_gen=False)")
        sound = np.concatenate([np.asarray(s)[:, : sh[0]].T for s, sh in zip(kw["sound_tokens"],
                                                                              kw["sound_token_shapes"])])
        place("sound", SOUND, sound, kw["sound_sequence_indexes"], kw["sound_noisy_frame_indexes"],
              kw["sound_token_shapes"], kw["sound_timesteps"])
    if kw.get("action_tokens") is not None and kw.get("action_sequence_indexes") is not None:
        if not settings.action_gen:
            raise ReferenceSampleError("the sample has actions but the model has no action heads (action_gen=False)")
        shapes = kw["action_token_shapes"]
        action = np.concatenate([np.asarray(a)[: sh[0]] for a, sh in zip(kw["action_tokens"], shapes)])
        domains = np.concatenate([np.full(sh[0], int(d)) for d, sh in zip(kw["action_domain_ids"], shapes)])
        if domains.size and (domains.min() < 0 or domains.max() >= c.num_action_domains):
            raise ReferenceSampleError(f"action_domain_ids must be in [0, {c.num_action_domains})")
        timesteps = kw["action_timesteps"] if len(kw["action_mse_loss_indexes"]) else None
        place("action", ACTION, action, kw["action_sequence_indexes"], kw["action_noisy_frame_indexes"],
              shapes, timesteps, domains)
    return batch, x


def _unpack_rows(kw, name, T, V):
    rows = np.asarray(kw[f"{name}_mse_loss_indexes"], np.int64) - T
    if len(rows) and (rows.min() < 0 or rows.max() >= V):
        raise ReferenceSampleError(f"{name}_mse_loss_indexes must lie in the generator tokens [{T}, {T + V})")
    return rows


def predictions_to_reference(pred_VC: np.ndarray, kw: dict, config: Cosmos3Config) -> dict:
    """xlaopt's per-token generator predictions [V, C] -> the reference's output lists."""
    c, T = config, int(kw["und_len"])
    V = pred_VC.shape[0]
    out: dict = {"vision": [], "sound": None, "action": None}
    vis = pred_VC[_unpack_rows(kw, "vision", T, V), : c.latent_patch_dim]
    start = 0
    for latent, shape, frames in zip(kw["vision_tokens"], kw["vision_token_shapes"], kw["vision_noisy_frame_indexes"]):
        n = len(frames) * shape[1] * shape[2]
        out["vision"].append(unpatchify(vis[start:start + n], np.asarray(frames, np.int64),
                                        np.asarray(latent).shape[1:], c.patch_size))
        start += n
    if kw.get("sound_tokens") is not None and kw.get("sound_sequence_indexes") is not None:
        snd = pred_VC[_unpack_rows(kw, "sound", T, V), : c.sound_dim]
        out["sound"], start = [], 0
        for shape, frames in zip(kw["sound_token_shapes"], kw["sound_noisy_frame_indexes"]):
            o = np.zeros((c.sound_dim, shape[0]), np.float32)
            o[:, np.asarray(frames, np.int64)] = snd[start:start + len(frames)].T
            out["sound"].append(o)
            start += len(frames)
    if kw.get("action_tokens") is not None and kw.get("action_sequence_indexes") is not None:
        act = pred_VC[_unpack_rows(kw, "action", T, V), : c.action_dim]
        out["action"], start = [], 0
        for shape, frames in zip(kw["action_token_shapes"], kw["action_noisy_frame_indexes"]):
            o = np.zeros((shape[0], c.action_dim), np.float32)
            o[np.asarray(frames, np.int64)] = act[start:start + len(frames)]
            out["action"].append(o)
            start += len(frames)
    return out


def forward(params, config: Cosmos3Config, settings: ReferenceSettings, kw: dict, dtype: str = "float32",
            rope_inv_freq: tuple[float, ...] | None = None) -> dict:
    """xlaopt's predictions for one reference-style sample, in the reference's layout:
    {"vision": [[1, C, T, H, W], ...], "sound": [[C, T], ...] | None, "action": [[T, A], ...] | None}."""
    batch, x = sample_to_batch(kw, config, settings)
    model = Cosmos3(config, jnp.dtype(dtype), rope_inv_freq=rope_inv_freq)
    _, pred_BVC = jax.jit(lambda p, b, g: model.apply({"params": p}, b, g))(params, batch, x)
    return predictions_to_reference(np.asarray(pred_BVC[0], np.float32), kw, config)

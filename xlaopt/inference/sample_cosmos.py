"""Rectified-flow sampling of Cosmos 3's generator tokens from a text prompt, with the reasoner's
keys and values computed once per prompt and reused at every denoising step.

Why the cache is exact: attention in a Cosmos 3 layer flows one way. Reasoner queries see
reasoner keys only, so the reasoner's activations, and with them the keys and values its
tokens offer the generator's queries, do not depend on the generator tokens at all, hence
not on the noisy latents or sigma. `reasoner_kv` runs the reasoner tower over the prompt once
(per layer: `k_for_gen`, the keys through the Edge variant's side norm when it has one, and
the values, [L, B, T, N, K]); `generator_velocity` then runs only the generator tower, its
queries over concat(cached reasoner keys, its own keys) under the training forward's mask.
Both bind the model's own `MoTLayer` halves to its parameters (`models.cosmos3.reasoner_kv`,
`generator_given_kv`); `uncached_velocity` is the full `Cosmos3.apply`, kept for checking.

A request (`video_request`) is one sample per row: the prompt's tokens (segment 1, positions
(p, p, p)) then padding (segment 0) up to the text region's `text_len` tokens, and a generator
region of one video clip of V = frames x height x width latent tokens, all noisy (segment 1,
modality VIDEO). Every field is laid out by the synthetic producer's own packing code
(`xlaopt.data.packing.fill_row`), so positions are exactly a training row's: video tokens at
(t0 + t, h, w), t0 = the prompt's length + the config's temporal margin, time-major, with fps
modulation at the base frame rate. Padding is invisible to the generator (another segment).

Classifier-free guidance: velocity = v_uncond + g * (v_cond - v_uncond), both branches in one
batch of 2B rows each step (rows 0..B-1 conditional, B..2B-1 unconditional, the same latents
in both); g = 1 runs the conditional branch only, as diffusers skips CFG at 1.0. The
unconditional prompt is a negative prompt: diffusers' Cosmos3 pipeline (`Cosmos3OmniPipeline`)
tokenizes `negative_prompt`, the empty string by default, through the same chat template as the
prompt (plus the inverse duration / resolution templates, the end-of-text and vision-start
tokens), packs it as a text region of its own length and places that branch's generator
tokens after it. There is no tokenizer here: `NULL_PROMPT`, one token of id 0 (the id
padding carries), stands in for the tokenized empty prompt; a trained checkpoint would pass
its own tokenized negative prompt (`negative_prompt=`). Each row's generator positions follow
its own prompt's length, as the pipeline's do.

`CosmosSampler` compiles the reasoner prefill once and the per-step velocity once per shape
(sigma and the guidance scale traced, so every step and every sampler reuses it) and runs
Euler or Heun (`flow_schedule`), timing compile and each step.

On a mesh (`CosmosSampler(model, placement)`, `inference.placement`) the parameters sit in their
training layout, the request's rows (both branches) split over the batch axes where they
divide, the reasoner K/V [L, B, T, N, K] is laid out as the decode cache (`decode.CACHE_AXES`:
rows there, kv heads over `tensor`), and the latents [B, V, C] keep their rows' layout from
step to step (the velocity's output sharding is the latents'). With guidance, rows split over
`data` put each branch on its own device group (CFG parallel). A mesh with `context` (a placement
made with `positions=True`) splits each row's positions and runs every attention through
Ulysses' all-to-alls (`ulysses`): whole rows with a share of the heads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.packing import fill_row
from xlaopt.data.sample import Sample
from xlaopt.errors import UserError
from xlaopt.inference.decode import CACHE_AXES, SERVING_XLA_OPTIONS
from xlaopt.inference.flow_schedule import FlowSchedule, euler_step, heun_step
from xlaopt.models import cosmos3
from xlaopt.models.cosmos3 import VIDEO, Cosmos3
from xlaopt.models.layers import constrain

NULL_PROMPT = (0,)  # the default unconditional prompt (see the module docstring)
MIN_GUIDANCE, MAX_GUIDANCE = 1.0, 20.0
SAMPLERS = {"euler": 1, "heun": 2}  # name -> order of `flow_schedule`

# The batch fields the reasoner prefill reads, and those the generator's step reads.
TEXT_FIELDS = ("text_tokens_BT", "text_segment_ids_BT", "text_positions_3BT")
GEN_FIELDS = ("text_segment_ids_BT", "gen_segment_ids_BV", "gen_positions_3BV", "gen_modality_BV",
              "gen_action_domain_BV", "gen_noisy_BV", "gen_sigma_BV")
LATENT_AXES = ("batch", "seq", None)  # x_t [B, V, C]: as the batch contract's gen_x0_BVC


class ReasonerKV(NamedTuple):
    """The reasoner's per-layer keys (as the generator reads them) and values of a prompt batch."""
    k_LBTNK: jax.Array
    v_LBTNK: jax.Array


# ---- requests ----


def check_guidance(guidance) -> float:
    """The guidance scale as a float, or a UserError when it is not a finite number in [1, 20]."""
    ok = isinstance(guidance, (int, float, np.integer, np.floating)) and not isinstance(guidance, bool)
    if not ok or not math.isfinite(guidance) or not MIN_GUIDANCE <= guidance <= MAX_GUIDANCE:
        raise UserError(f"guidance {guidance!r}: the classifier-free guidance scale must be a finite number in "
                        f"[{MIN_GUIDANCE:g}, {MAX_GUIDANCE:g}] (1: no guidance, the conditional branch only)")
    return float(guidance)


def clip_grid(gen_len: int, frames: int | None = None) -> tuple[int, int, int]:
    """A (frames, height, width) latent grid of `gen_len` tokens: `frames` (default the largest of
    4, 2, 1 dividing gen_len) by the most nearly square height x width."""
    if gen_len < 1:
        raise UserError(f"gen_len {gen_len}: a clip needs at least one generator token")
    if frames is None:
        frames = next(f for f in (4, 2, 1) if gen_len % f == 0)
    if frames < 1 or gen_len % frames:
        raise UserError(f"frames {frames}: must be a positive divisor of the {gen_len} generator tokens")
    spatial = gen_len // frames
    height = max(h for h in range(1, math.isqrt(spatial) + 1) if spatial % h == 0)
    return frames, height, spatial // height


def _check_prompt(tokens, text_len: int, vocab: int, what: str) -> np.ndarray:
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{what} of shape {ids.shape} ({ids.dtype}): give a 1-D array of at least one token id")
    if ids.size > text_len:
        raise UserError(f"{what} of {ids.size} tokens does not fit the reasoner's cache of text_len={text_len} "
                        f"positions; give text_len >= {ids.size} or a shorter prompt")
    if ids.min() < 0 or ids.max() >= vocab:  # jnp.take would read NaN rows, not fail
        raise UserError(f"{what} token ids span [{ids.min()}, {ids.max()}]; the vocabulary is [0, {vocab - 1}]")
    return ids.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class VideoRequest:
    """Host arrays of the batch contract (`cosmos3_batch_spec`), 2B rows under guidance
    (conditional rows first), B without; `gen_sigma_BV` is set at each step."""
    batch: dict
    rows: int  # B: samples asked for
    grid: tuple[int, int, int]
    guidance: float

    @property
    def cfg(self) -> bool:
        return self.guidance != 1.0

    def noise(self, config, key) -> jax.Array:
        """x_T [B, V, C]: a standard normal draw on the video latent's channels, zeros beyond
        (channels video tokens neither read nor predict)."""
        V, C, P = self.batch["gen_segment_ids_BV"].shape[1], config.generator_in_dim, config.latent_patch_dim
        x_BVP = jax.random.normal(key, (self.rows, V, P), jnp.float32)
        return jnp.pad(x_BVP, ((0, 0), (0, 0), (0, C - P)))


def video_request(config, prompts: Sequence, text_len: int, grid: tuple[int, int, int], guidance: float = 1.0,
                  negative_prompt: Sequence[int] = NULL_PROMPT, fps: float | None = None) -> VideoRequest:
    """A request for one clip of `grid` per prompt (each a 1-D array of token ids, at most
    `text_len`); with guidance != 1 the unconditional rows hold `negative_prompt`."""
    guidance = check_guidance(guidance)
    texts = [_check_prompt(p, text_len, config.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
    if not texts:
        raise UserError("no prompts: give at least one")
    if guidance != 1.0:
        texts += [_check_prompt(negative_prompt, text_len, config.vocab_size, "negative prompt")] * len(texts)
    frames, height, width = (int(g) for g in grid)
    V = frames * height * width
    spec = cosmos3_batch_spec(config, BatchShape(len(texts), text_len, V))
    batch = {k: np.zeros(shape, dtype) for k, (shape, dtype, _) in spec.items()}
    latents = np.zeros((V, config.latent_patch_dim), np.float32)  # overwritten by x_t at every step
    for row, text in enumerate(texts):
        sample = Sample(text, VIDEO, latents, (frames, height, width), 0, 0, fps)
        sample.validate(f"request row {row}")
        fill_row(batch, row, [sample], [1.0], config)
    return VideoRequest(batch, len(prompts), (frames, height, width), guidance)


def rows_of(batch: dict, start: int, stop: int) -> dict:
    """Rows start..stop-1 of a batch (positions carry their (t, h, w) axis first)."""
    return {k: (v[:, start:stop] if k.endswith("_3BT") or k.endswith("_3BV") else v[start:stop])
            for k, v in batch.items()}


# ---- velocities ----


def at_sigma(batch: dict, sigma) -> dict:
    """The batch with every generator token at noise level `sigma` (a scalar, traced or not)."""
    return {**batch, "gen_sigma_BV": jnp.broadcast_to(jnp.asarray(sigma, jnp.float32),
                                                      batch["gen_segment_ids_BV"].shape)}


def reasoner_params(params) -> dict:
    """The parameters the reasoner prefill reads: the embedding and the reasoner's layers."""
    return {"embed_ED": params["embed_ED"], "layers": {"reasoner": params["layers"]["reasoner"]}}


def generator_params(params) -> dict:
    """The parameters a denoising step reads: the generator tower, its I/O and final norm. A step
    given only these cannot recompute the reasoner."""
    return {"generator_io": params["generator_io"], "generator_final_norm": params["generator_final_norm"],
            "layers": {"generator": params["layers"]["generator"]}}


def reasoner_kv(model: Cosmos3, params, batch: dict) -> ReasonerKV:
    """The reasoner over the text region, once: per layer the keys the generator reads and the
    values, [L, B, T, N, K] (on a mesh laid out as a decode cache; `constrain` is a no-op on one device)."""
    return ReasonerKV(*(constrain(a, CACHE_AXES) for a in cosmos3.reasoner_kv(model, params, batch)))


def generator_velocity(model: Cosmos3, params, batch: dict, x_t_BVC, sigma, cache: ReasonerKV) -> jax.Array:
    """The predicted velocity [B, V, C] (fp32) at `x_t_BVC`, noise level `sigma`, from the cached
    reasoner keys and values: the generator tower only."""
    return cosmos3.generator_given_kv(model, params, at_sigma(batch, sigma), x_t_BVC, cache.k_LBTNK, cache.v_LBTNK)


def uncached_velocity(model: Cosmos3, params, batch: dict, x_t_BVC, sigma) -> jax.Array:
    """The same velocity from the full training forward (text and generator), for checking."""
    return model.apply({"params": params}, at_sigma(batch, sigma), x_t_BVC)[1]


def guided(velocity_fn: Callable, x_BVC, guidance, cfg: bool) -> jax.Array:
    """`velocity_fn(x_RVC)` over the request's rows, combined under classifier-free guidance: both
    branches in one batch (x repeated for the unconditional rows), v_u + g * (v_c - v_u) in fp32."""
    if not cfg:
        return velocity_fn(x_BVC)
    v_cond_BVC, v_uncond_BVC = jnp.split(velocity_fn(jnp.concatenate([x_BVC, x_BVC])).astype(jnp.float32), 2)
    return v_uncond_BVC + guidance * (v_cond_BVC - v_uncond_BVC)


def _cached_step(model, cfg, gen_params, batch, x_BVC, sigma, guidance, cache):
    return guided(lambda x: generator_velocity(model, gen_params, batch, x, sigma, cache), x_BVC, guidance, cfg)


def _uncached_step(model, cfg, params, batch, x_BVC, sigma, guidance):
    return guided(lambda x: uncached_velocity(model, params, batch, x, sigma), x_BVC, guidance, cfg)


# ---- the sampling loop ----


class Sampled(NamedTuple):
    x0_BVC: np.ndarray  # the sampled latents, fp32
    stats: dict  # compile_s, prefill_s, step_s (per denoising step), wall_per_step_s (median), model_calls


def integrate(velocity_fn: Callable, x_T, schedule: FlowSchedule, order: int) -> tuple[jax.Array, list[float]]:
    """`flow_schedule.sample`'s loop, waiting for each step to finish to time it: (x_0, seconds per step)."""
    if order not in (1, 2):
        raise UserError(f"order {order!r}: the sampler order must be 1 (Euler) or 2 (Heun)")
    sigmas = [float(s) for s in schedule.sigmas()]
    x, step_s = x_T, []
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        t0 = time.perf_counter()
        if order == 1:
            x = euler_step(x, velocity_fn(x, jnp.float32(sigma)), sigma, sigma_next)
        else:
            x = heun_step(velocity_fn, x, sigma, sigma_next)
        x.block_until_ready()
        step_s.append(time.perf_counter() - t0)
    return x, step_s


class CosmosSampler:
    """Sampling for one Cosmos 3 model: the reasoner prefill and the per-step velocity (cached and
    uncached) are compiled on first use per shape and kept."""

    def __init__(self, model: Cosmos3, placement=None):
        if not isinstance(model, Cosmos3):
            raise UserError(f"sampling needs a Cosmos 3 model (it has a generator tower), not "
                            f"{type(model).__name__}")
        self.model = model
        self.placement = placement  # an `inference.placement.Placement`, or None: one device
        self._compiled: dict = {}

    def prefill(self, params, request: VideoRequest) -> tuple[ReasonerKV, dict]:
        """The reasoner K/V of every row of the request (both branches: one prefill), and its times."""
        args = (reasoner_params(self._put_params(params)), self._put_batch(request.batch, TEXT_FIELDS))
        exe, compile_s = self._executable("prefill", lambda p, b: reasoner_kv(self.model, p, b), args)
        t0 = time.perf_counter()
        cache = jax.block_until_ready(exe(*args))
        return cache, dict(compile_s=compile_s, run_s=time.perf_counter() - t0)

    def sample(self, params, request: VideoRequest, x_T_BVC, schedule: FlowSchedule, order: int = 1,
               cached: bool = True) -> Sampled:
        """x_0 [B, V, C] from the noise `x_T_BVC` over `schedule` (order 1 Euler, 2 Heun); `cached`:
        the reasoner K/V once and the generator per step, else the full model per step."""
        params = self._put_params(params)
        guidance, sigma0 = self._scalar(request.guidance), self._scalar(1.0)
        x_T_BVC = self._put_latents(x_T_BVC)
        prefill = dict(compile_s=0.0, run_s=0.0)
        if cached:
            cache, prefill = self.prefill(params, request)
            batch = self._put_batch(request.batch, GEN_FIELDS)
            args = (generator_params(params), batch, x_T_BVC, sigma0, guidance, cache)
            fn = lambda p, b, x, s, g, c: _cached_step(self.model, request.cfg, p, b, x, s, g, c)
        else:
            batch = self._put_batch(request.batch, tuple(request.batch))
            args = (params, batch, x_T_BVC, sigma0, guidance)
            fn = lambda p, b, x, s, g: _uncached_step(self.model, request.cfg, p, b, x, s, g)
        # On a mesh the velocity leaves in the latents' layout, so each step's x is where it was compiled for.
        latents = None if self.placement is None else x_T_BVC.sharding
        exe, step_compile_s = self._executable(("cached" if cached else "uncached", request.cfg), fn, args, latents)
        calls = [0]

        def velocity(x, sigma):
            calls[0] += 1
            return exe(args[0], batch, self._put_latents(x), self._scalar(sigma), *args[4:])

        x0, step_s = integrate(velocity, x_T_BVC, schedule, order)
        stats = dict(cached=cached, cfg=request.cfg, compile_s=prefill["compile_s"] + step_compile_s,
                     prefill_compile_s=prefill["compile_s"], step_compile_s=step_compile_s,
                     prefill_s=prefill["run_s"], step_s=step_s, wall_per_step_s=float(np.median(step_s)),
                     total_s=prefill["run_s"] + sum(step_s), model_calls=calls[0])
        return Sampled(np.asarray(x0), stats)

    def flops(self) -> list[dict]:
        """XLA's FLOP count of each executable compiled so far: what the cache saves per step."""
        def count(exe):
            cost = exe.cost_analysis()
            return float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0))

        name = lambda n: n if isinstance(n, str) else f"{n[0]} step, cfg {'on' if n[1] else 'off'}"
        return [dict(executable=name(key[0]), flops=count(exe)) for key, exe in self._compiled.items()]

    def _executable(self, name, fn, args, out_shardings=None):
        """(compiled fn, seconds spent compiling now): lowered ahead of time, so compile time is
        measured apart from the first step's run time. args[1] is (part of) the request's batch."""
        key = (name, tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves(args)))
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        rows = args[1]["text_segment_ids_BT"].shape[0]
        on_mesh = contextlib.nullcontext() if self.placement is None else self.placement.tracing(rows)
        lengths = [args[1][k].shape[1] for k in ("text_segment_ids_BT", "gen_segment_ids_BV") if k in args[1]]
        with on_mesh, ulysses(self.placement, self.model.config, lengths):
            exe = jax.jit(fn, out_shardings=out_shardings).lower(*args).compile(compiler_options=SERVING_XLA_OPTIONS)
        self._compiled[key] = exe
        return exe, time.perf_counter() - t0

    # Inputs as jax arrays, placed on the mesh when there is one (already placed ones stay put).

    def _put_params(self, params):
        params = nn.meta.unbox(params)
        return params if self.placement is None else self.placement.put_params(params)

    def _put_batch(self, batch: dict, fields: Sequence[str]) -> dict:
        batch = {k: jnp.asarray(batch[k]) for k in fields}
        if self.placement is None:
            return batch
        return self.placement.put_tree(batch, _batch_axes(self.model.config, batch), "request field")

    def _put_latents(self, x_BVC) -> jax.Array:
        x_BVC = jnp.asarray(x_BVC, jnp.float32)
        return x_BVC if self.placement is None else self.placement.put(x_BVC, LATENT_AXES, "the latents")

    def _scalar(self, value) -> jax.Array:
        value = jnp.float32(value)
        return value if self.placement is None else self.placement.replicate(value)


def ulysses(placement, config, lengths: Sequence[int] = ()):
    """Where the placement splits positions over `context`: every attention traced inside runs
    through Ulysses' all-to-alls (`transforms.ulysses_attention`), whole rows with a share of the
    heads, the generator's queries over the cached text keys and its own alike (both lengths must
    divide the context ranks). A no-op elsewhere."""
    context = 1 if placement is None else placement.spec.size("context")
    if context == 1:
        return contextlib.nullcontext()
    from xlaopt.models.attention import attention_through
    from xlaopt.transforms.ulysses_attention import UlyssesAttentionTransform, ulysses_split

    split = ulysses_split(config.num_heads, config.num_kv_heads, placement.spec.size("tensor"), context)
    if split is None:
        raise UserError(f"mesh {placement.spec}: {config.num_heads} query heads and {config.num_kv_heads} kv heads "
                        f"over tensor x context do not split for Ulysses; use a context size that divides each "
                        f"tensor rank's query heads")
    bad = [n for n in lengths if n % context]
    if bad:
        raise UserError(f"mesh {placement.spec}: a row's {' and '.join(map(str, lengths))} text and clip tokens must "
                        f"each divide context={context} for Ulysses; pad the prompt or pick another clip size")
    repeat, chunks = split
    return attention_through(UlyssesAttentionTransform("context", chunks=chunks, kv_repeat=repeat).attend,
                             sequence_axis="context")


def _batch_axes(config, batch: dict) -> dict:
    """Logical axes of each field of a request batch, from the batch contract."""
    R, T = batch["text_segment_ids_BT"].shape
    V = batch["gen_segment_ids_BV"].shape[1] if "gen_segment_ids_BV" in batch else 0
    spec = cosmos3_batch_spec(config, BatchShape(R, T, V))
    return {k: spec[k][2] for k in batch}

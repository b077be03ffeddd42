"""`xlaopt generate`: sample from a model: a registered one with its own init (seeded), to
measure and check the inference paths, or a checkpoint's (`--ckpt DIR`, from `xlaopt train` or
`xlaopt import-weights`; its model is the one it was saved from).

Two modes:
  video  Cosmos 3 only: rectified-flow sampling of one video clip per prompt through
         `xlaopt.inference.sample_cosmos` with the reasoner's K/V cached, classifier-free
         guidance in one batch of both branches; then the same steps uncached (the full model
         every step) from the same noise, reported as a speedup and a max difference.
  text   KV-cached decoding (`xlaopt.inference.decode.Decoding`): decoder LLMs always, Cosmos 3's
         reasoner with --decode-text.
Options of the other mode, or a model with neither path (ViT), end in one-line UserErrors.

Sharded: `--mesh data=2,tensor=2` (or a layout file's mesh) runs both modes on that mesh of
simulated CPU devices, requested before JAX starts (`xlaopt.inference.placement`: parameters in
the training layout of the rule table, rows over data/fsdp where they divide, the KV caches'
kv heads over tensor). A mesh whose axes do not divide the model's parameters (a tensor size
that does not divide the heads or the vocabulary), or one that splits positions (context), is
refused in one line.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.errors import UserError
from xlaopt.mesh import request_cpu_devices
from xlaopt.models.registry import get_config, parse_overrides

# Defaults of the options a request leaves None (None: "not given", so a mode can refuse the
# other mode's options).
VIDEO_DEFAULTS = dict(steps=10, guidance=3.0, sampler="euler", shift=None, gen_len=64, frames=None)
TEXT_DEFAULTS = dict(new_tokens=16, temperature=None)
PROMPT_LEN = 16


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """What to generate; None is "not given": the mode's default, or a layout file's batch."""
    model: str | None  # with `ckpt`, None: the checkpoint's own model
    overrides: tuple[str, ...] = ()  # KEY=VALUE config fields
    ckpt: str | None = None  # serve this checkpoint's parameters
    ckpt_step: int | None = None  # default: its newest
    mesh: str = ""
    layout: str | None = None  # a layout file instead of `mesh`
    dtype: str | None = None  # default: the layout's, else float32
    batch_size: int | None = None
    prompt: str | None = None  # comma-separated token ids
    prompt_len: int | None = None
    text_len: int | None = None
    seed: int = 0
    decode_text: bool = False
    gen_len: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    sampler: str | None = None
    shift: float | None = None
    new_tokens: int | None = None
    temperature: float | None = None

    def options(self, defaults: dict) -> dict:
        """The mode's options: each one given, else its default."""
        return {k: v if getattr(self, k) is None else getattr(self, k) for k, v in defaults.items()}


def _given(request: GenerateRequest, names) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if getattr(request, n) is not None]


def choose_mode(config, request: GenerateRequest) -> str:
    """'video' or 'text' for this model and these options, or a UserError saying why neither."""
    from xlaopt.families import family_of

    family = family_of(config)
    video_opts, text_opts = _given(request, VIDEO_DEFAULTS), _given(request, TEXT_DEFAULTS)
    if family.generates_video and not request.decode_text:
        if text_opts:
            raise UserError(f"{', '.join(text_opts)}: text decoding options; add --decode-text to decode "
                            f"{config.name}'s reasoner text instead of sampling video")
        return "video"
    if not family.decodes_text:
        raise UserError(f"{config.name} ({config.family}) has no generator to sample and no text head to "
                        f"decode; generate works with Cosmos 3 (video, or --decode-text) and decoder LLMs (text)")
    if video_opts and not family.generates_video:
        raise UserError(f"{config.name} has no generator tower: it cannot sample video ({', '.join(video_opts)}); "
                        f"decode text with --new-tokens N")
    if video_opts:
        raise UserError(f"{', '.join(video_opts)}: video sampling options, but --decode-text decodes "
                        f"{config.name}'s reasoner text; drop one or the other")
    return "text"


def _execution(layout, dtype: str):
    from xlaopt.execution import ExecutionConfig

    return dataclasses.replace(layout.execution or ExecutionConfig(), compute_dtype=dtype)


def _model(config, execution):
    from xlaopt.families import family_of

    return family_of(config).module(config, execution)


def _placement(config, layout, execution, positions: bool = False):
    """None on one device; else the model's training layout on the mesh, whose simulated CPU
    devices are asked for first (before anything starts JAX's backends). `positions`: a video's
    sampler splits a row's positions over `context` (Ulysses); text decoding does not."""
    from xlaopt.inference.placement import placement_or_none

    if layout.mesh.num_devices > 1:
        request_cpu_devices(layout.mesh.num_devices)
    return placement_or_none(config, layout.mesh, execution, layout.rules, positions=positions)


def _init_params(model, batch: dict, seed: int, placement=None):
    """The model's own initialisation, seeded (parameters do not depend on the batch's shape);
    on a mesh created directly in their layout."""
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    init = lambda key, b: nn.meta.unbox(model.init(key, b))["params"]
    shardings = None if placement is None else placement.param_shardings
    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed), batch)


def _prompts(request: GenerateRequest, config, rows: int) -> np.ndarray:
    """[rows, P] token ids: --prompt's (every row the same) or random ids of --prompt-len drawn from --seed."""
    if request.prompt is not None:
        try:
            ids = [int(t) for t in request.prompt.split(",") if t.strip()]
        except ValueError:
            raise UserError(f"--prompt {request.prompt!r}: give comma-separated token ids, e.g. 5,17,300") from None
        return np.tile(np.asarray(ids, np.int32), (rows, 1))
    length = PROMPT_LEN if request.prompt_len is None else request.prompt_len
    if length < 1:
        raise UserError(f"--prompt-len {length}: a prompt needs at least one token")
    return np.random.default_rng(request.seed).integers(0, config.vocab_size, (rows, length)).astype(np.int32)


def generate(request: GenerateRequest) -> dict:
    """The command's result. The layout is read once the mode is chosen (its batch fills the
    options the request leaves unset, and must not count as the other mode's)."""
    from xlaopt.build import BatchRequest, choose_layout

    saved, config = _model_config(request)
    mode = choose_mode(config, request)
    layout = choose_layout(request.mesh, request.layout, request.model or saved.meta["model"])
    given = BatchRequest(request.batch_size, request.text_len, request.gen_len).over(layout.batch)
    dtype = request.dtype or (layout.execution.compute_dtype if layout.execution is not None else "float32")
    request = dataclasses.replace(request, dtype=dtype, **dataclasses.asdict(given))
    rows = 1 if request.batch_size is None else request.batch_size
    if rows < 1:
        raise UserError(f"--batch-size {rows}: need at least one row")
    execution = _execution(layout, dtype)
    placement = _placement(config, layout, execution, positions=mode == "video")
    model = _model(config, execution)
    prompt_BP = _prompts(request, config, rows)
    common = dict(model=config.name, family=config.family, mode=mode, dtype=dtype, batch_size=rows,
                  prompt_len=int(prompt_BP.shape[1]), seed=request.seed, mesh=layout.mesh.as_dict(),
                  params_from=({"ckpt": saved.directory, "step": saved.step} if saved else
                               {"init_seed": request.seed}))
    run = generate_video if mode == "video" else generate_text
    params = functools.partial(_params, saved, model, request.seed, placement)
    return common | run(request, config, model, prompt_BP, params, placement)


def _model_config(request: GenerateRequest):
    """(the checkpoint to serve or None, the model's config)."""
    from xlaopt.inference.checkpoint_params import SavedRun

    if request.model is None and request.ckpt is None:
        raise UserError("give --model NAME (its own init) or --ckpt DIR (a trained or imported checkpoint)")
    given = None if request.model is None else get_config(request.model, parse_overrides(request.model,
                                                                                         request.overrides))
    if request.ckpt is None:
        return None, given
    if request.overrides and request.model is None:
        raise UserError("--set changes a registered model's fields: with --ckpt the model is the checkpoint's own")
    saved = SavedRun.open(request.ckpt, request.ckpt_step)
    return saved, saved.config(given)


def _params(saved, model, seed: int, placement, batch: dict):
    """The checkpoint's parameters, or the model's own init from `seed`."""
    if saved is None:
        return _init_params(model, batch, seed, placement)
    return saved.params(model, batch, placement)


def generate_video(request: GenerateRequest, config, model, prompt_BP, params_for, placement=None) -> dict:
    from xlaopt.data.synthetic_cosmos import RESOLUTION_SHIFT
    from xlaopt.inference import sample_cosmos as sc
    from xlaopt.inference.flow_schedule import FlowSchedule

    o = request.options(VIDEO_DEFAULTS)
    # The sampling shift defaults to the one the synthetic data's sigmas are trained at (256p).
    shift = RESOLUTION_SHIFT if o["shift"] is None else o["shift"]
    schedule = FlowSchedule(o["steps"], shift)  # refuses a bad step count or shift
    order = sc.SAMPLERS[o["sampler"]]
    text_len = prompt_BP.shape[1] if request.text_len is None else request.text_len
    video = sc.video_request(config, list(prompt_BP), text_len, sc.clip_grid(o["gen_len"], o["frames"]),
                             o["guidance"])
    params = params_for(video.batch)
    x_T_BVC = video.noise(config, jax.random.key(request.seed + 1))
    sampler = sc.CosmosSampler(model, placement)
    cached = sampler.sample(params, video, x_T_BVC, schedule, order, cached=True)
    uncached = sampler.sample(params, video, x_T_BVC, schedule, order, cached=False)
    pick = lambda s: {k: s[k] for k in ("compile_s", "prefill_compile_s", "step_compile_s", "prefill_s",
                                        "wall_per_step_s", "total_s", "model_calls", "step_s")}
    return dict(
        steps=o["steps"], sampler=o["sampler"], shift=shift, guidance=video.guidance, cfg=video.cfg,
        text_len=text_len, gen_len=int(np.prod(video.grid)), grid=list(video.grid),
        rows_per_step=video.batch["text_tokens_BT"].shape[0],
        output_shapes={"latents_BVC": list(cached.x0_BVC.shape)},
        compile_s=cached.stats["compile_s"], wall_per_step_s=cached.stats["wall_per_step_s"],
        prefill_s=cached.stats["prefill_s"],
        speedup_vs_uncached=uncached.stats["wall_per_step_s"] / cached.stats["wall_per_step_s"],
        max_abs_diff_vs_uncached=float(np.abs(cached.x0_BVC - uncached.x0_BVC).max()),
        latents_mean=float(cached.x0_BVC.mean()), latents_std=float(cached.x0_BVC.std()),
        cached=pick(cached.stats), uncached=pick(uncached.stats))


def generate_text(request: GenerateRequest, config, model, prompt_BP, params_for, placement=None) -> dict:
    from xlaopt.data.batch import BatchShape
    from xlaopt.families import family_of
    from xlaopt.inference.decode import Decoding

    o = request.options(TEXT_DEFAULTS)
    rows, P = prompt_BP.shape
    family = family_of(config)
    spec = family.batch_spec(config, BatchShape(rows, P, 1 if family.generates_video else 0))
    params = params_for({k: np.zeros(s, d) for k, (s, d, _) in spec.items()})
    key = None if o["temperature"] is None else jax.random.key(request.seed)
    out = Decoding(model, placement).generate(params, prompt_BP, o["new_tokens"], temperature=o["temperature"],
                                              key=key, cache_len=request.text_len)
    s = out.stats
    step_s = s["decode_step_s"]
    return dict(new_tokens=o["new_tokens"], temperature=o["temperature"], greedy=o["temperature"] is None,
                cache_len=P + o["new_tokens"] if request.text_len is None else request.text_len,
                output_shapes={"tokens_BN": list(out.tokens_BN.shape)}, tokens=out.tokens_BN.tolist(),
                compile_s=s["prefill_compile_s"] + s["decode_compile_s"], prefill_compile_s=s["prefill_compile_s"],
                decode_compile_s=s["decode_compile_s"], prefill_s=s["prefill_s"],
                wall_per_step_s=float(np.median(step_s)) if step_s else None, step_s=step_s)


def format_generation(r: dict) -> str:
    split = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1)
    where = f" on {split}" if split else ""
    if "ckpt" in r["params_from"]:
        where += f", step {r['params_from']['step']} of {r['params_from']['ckpt']}"
    if r["mode"] == "text":
        how = "greedy" if r["greedy"] else f"temperature {r['temperature']:g}"
        per = "" if r["wall_per_step_s"] is None else f", {r['wall_per_step_s'] * 1e3:.2f} ms/token"
        return (f"generate {r['model']} (text{where}): {r['batch_size']} x {r['new_tokens']} new tokens after "
                f"{r['prompt_len']} prompt tokens, {how}: compile {r['compile_s']:.2f} s, prefill "
                f"{r['prefill_s'] * 1e3:.2f} ms{per}")
    guide = (f"guidance {r['guidance']:g} (both branches in one batch of {r['rows_per_step']} rows)" if r["cfg"]
             else "no guidance")
    grid = "x".join(map(str, r["grid"]))
    return (f"generate {r['model']} (video{where}): {r['batch_size']} clip(s) of {grid} latent tokens after "
            f"{r['prompt_len']} prompt tokens, {r['steps']} {r['sampler']} steps (shift {r['shift']:g}), {guide}: "
            f"compile {r['compile_s']:.2f} s; {r['wall_per_step_s'] * 1e3:.2f} ms/step with the reasoner K/V cached "
            f"vs {r['uncached']['wall_per_step_s'] * 1e3:.2f} ms uncached ({r['speedup_vs_uncached']:.2f}x), "
            f"max |cached - uncached| {r['max_abs_diff_vs_uncached']:.3g}")

"""A Cosmos 3 text-to-video request priced whole, and the layouts that serve it.

A request (`inference.video_profile.VideoProfile`) is `steps` denoising steps of the generator,
each running the guided branches (the prompt's row and the negative prompt's), then the VAE
decode of the clean latent. Two samplers are priced:
  cached    xlaopt's (`inference.sample_cosmos`): the reasoner's keys and values computed once a
            prompt, each step runs the generator tower alone over the clip's tokens, its queries
            over the cached text keys and its own;
  uncached  the whole joint sequence (text and clip, both towers) every step, as NVIDIA's PyTorch
            reference did when its benchmark was published (cosmos-framework 2026-06-07: no text
            K/V reuse; it came on 2026-07-27, for one GPU only).
Layouts are products over one node's devices (data replicas across nodes):
  cfg       the two guidance branches on two device groups, swapping their velocities each
            step (a send of the latent's size); without it one group runs both, one after the other
  sp        Ulysses over the sequence: each device projects 1/sp of the tokens with whole weights,
            four all-to-alls a layer (q, k, v to whole rows with 1/sp of the heads, the output back)
  tp        tensor parallel: 1/tp of every weight and head, two all-reduces of the activations a layer
  data      replicas, each serving its own requests (throughput, not latency)
NVIDIA's reference runs cfg = min(2, devices) x Ulysses over the rest (its `latency` preset;
`tp_size` is fixed at 1), whatever its benchmark page's note calls it. Nothing here overlaps a
collective with compute: the reference does not, and a step's attention waits on its all-to-all.
The VAE decode runs on one device of the group (the reference decodes on one rank) and is priced
from its convolutions (`planning.vae_cost`); tokenizing and writing the video are not priced.

Efficiencies: the large-matmul fraction is the training fit's (`costmodel.FITTED`); fused
attention's forward alone has its own published throughput (`costmodel.FORWARD_ATTENTION`), since
the fit's `attention` prices a forward and a backward together.
"""
from __future__ import annotations

import dataclasses

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.topology import Topology
from xlaopt.errors import UserError
from xlaopt.inference.video_profile import VideoProfile
from xlaopt.mesh import DEVICE_ORDER_TENSOR_INNER, MeshSpec
from xlaopt.planning.serving import tower_forward_s
from xlaopt.planning.shapes import tower_shape
from xlaopt.planning.vae_cost import decoder_flops

_BF16 = 2


@dataclasses.dataclass(frozen=True)
class VideoLayout:
    data: int
    cfg: int
    sp: int
    tp: int

    @property
    def mesh(self) -> MeshSpec:
        """CFG parallel is the data axis splitting a request's two branch rows."""
        return MeshSpec.of(DEVICE_ORDER_TENSOR_INNER, data=self.data * self.cfg, context=self.sp, tensor=self.tp)

    @property
    def name(self) -> str:
        parts = [f"{n}{v}" for n, v in (("dp", self.data), ("cfg", self.cfg), ("sp", self.sp), ("tp", self.tp))
                 if v > 1]
        return " x ".join(parts) or "one device"


@dataclasses.dataclass(frozen=True)
class VideoPrice:
    layout: VideoLayout
    cached: bool
    seconds: float  # one request, start to decoded video
    parts: dict  # seconds of the whole request: prompt, steps' matmuls, attention, tp, sp, cfg, vae
    step_s: float
    memory_bytes: float
    reason: str = ""

    @property
    def videos_per_s(self) -> float:
        return self.layout.data / self.seconds


def _branch_step(config, text: int, gen: int, cached: bool, layout: VideoLayout, topology: Topology,
                 eff: cm.Efficiency) -> dict:
    """One branch's forward on one device of its group: matmuls, attention and its collectives."""
    L, tp, sp = config.num_layers, layout.tp, layout.sp
    tokens = gen + (0 if cached else text)  # through a tower this step
    pairs = gen * (text + gen) + (0 if cached else text * (text + 1) / 2)
    matmuls, attention = tower_forward_s(config, tokens, pairs, tp * sp, topology, eff)
    local = tokens / sp
    tp_span = cm.group_span(tp, 1, topology.devices_per_node)
    sp_span = cm.group_span(sp, tp, topology.devices_per_node)
    kv_heads = max(config.num_kv_heads / tp, 1.0)
    a2a_bytes = local * (2 * config.num_heads * config.head_dim / tp + 2 * kv_heads * config.head_dim) * _BF16
    return {"matmuls": matmuls, "attention": attention,
            "tp": L * 2 * cm.collective_time_s("all-reduce", local * config.d_model * _BF16, tp_span, topology, eff),
            "sp": L * cm.collective_time_s("reduce-scatter", a2a_bytes, sp_span, topology, eff)}


def _prompt_once(config, texts: tuple[int, ...], layout: VideoLayout, topology: Topology, eff: cm.Efficiency) -> float:
    """The cached sampler's one reasoner pass a prompt (both branches' texts on one group without cfg)."""
    per_group = texts if layout.cfg == 1 else (max(texts),)
    return sum(sum(tower_forward_s(config, t, t * (t + 1) / 2, layout.tp * layout.sp, topology, eff))
               for t in per_group)


def vae_decode_s(config, profile: VideoProfile, topology: Topology, eff: cm.Efficiency) -> float:
    """The decode on one device: its convolutions as matmuls of their mean size (`vae_cost`)."""
    work = decoder_flops(*profile.latent_shape())
    dev = topology.device
    peak = dev.peak_flops["bfloat16"]
    return cm.matmul_time_s(work.flops, peak, work.flops / work.calls, eff.matmul_max_for(dev.name),
                            eff.matmul_half_flops)


def _memory_bytes(config, profile: VideoProfile, layout: VideoLayout, cached: bool) -> float:
    """Weights of both towers and the embeddings (whole under Ulysses, 1/tp under tensor), the
    cached text K/V, and a layer's activations of the local tokens."""
    shape = tower_shape(config)
    weights = (2 * config.num_layers * shape.layer_params + 2 * config.vocab_size * config.d_model) * _BF16 / layout.tp
    texts = profile.branch_text_tokens()
    group_texts = texts if layout.cfg == 1 else (max(texts),)
    kv = (config.num_layers * sum(group_texts) * 2 * max(config.num_kv_heads / layout.tp, 1.0) * config.head_dim
          * _BF16) if cached else 0.0
    tokens = (profile.gen_tokens(config.patch_size) + (0 if cached else max(texts))) / layout.sp
    activations = 8 * tokens * max(config.d_model, config.mlp_dim / layout.tp) * _BF16
    return weights + kv + activations


def price_video(config, profile: VideoProfile, layout: VideoLayout, topology: Topology, eff: cm.Efficiency,
                cached: bool = True) -> VideoPrice:
    """One request on one replica of `layout`: steps x (its group's branches, one after the other,
    or the slower of the two groups under cfg, and the velocity swap) + the prompt + the decode;
    `eff`: `costmodel.serving_efficiency` (attention forward only)."""
    gen = profile.gen_tokens(config.patch_size)
    branches = [_branch_step(config, t, gen, cached, layout, topology, eff) for t in profile.branch_text_tokens()]
    if layout.cfg == 2:
        slowest = max(branches, key=lambda b: sum(b.values()))
        step = dict(slowest)
        swap = gen * config.latent_patch_dim * 4.0  # an fp32 velocity each way
        step["cfg"] = cm.send_time_s(swap, topology.levels[0], eff.nvlink)
    else:
        step = {k: sum(b[k] for b in branches) for k in branches[0]}
        step["cfg"] = 0.0
    parts = {k: profile.steps * v for k, v in step.items()}
    parts["prompt"] = _prompt_once(config, profile.branch_text_tokens(), layout, topology, eff) if cached else 0.0
    parts["vae"] = vae_decode_s(config, profile, topology, eff)
    return VideoPrice(layout, cached, sum(parts.values()), parts, sum(step.values()),
                      _memory_bytes(config, profile, layout, cached))


def reference_layout(devices: int, guided: bool = True) -> VideoLayout:
    """NVIDIA's reference on `devices` GPUs: cfg = min(2, devices), Ulysses over the rest."""
    cfg = 2 if guided and devices >= 2 else 1
    return VideoLayout(1, cfg, devices // cfg, 1)


def _why_not(config, layout: VideoLayout, profile: VideoProfile) -> str:
    split = layout.tp * layout.sp
    if config.num_heads % split:
        return f"{config.num_heads} heads do not split over tp x sp = {split}"
    if config.mlp_dim % layout.tp or config.vocab_size % layout.tp:
        return f"MLP {config.mlp_dim} or vocabulary {config.vocab_size} do not split over tp={layout.tp}"
    if layout.cfg == 2 and not profile.guided:
        return "cfg parallel needs guidance (two branches)"
    return ""


def layouts(topology: Topology, guided: bool) -> list[VideoLayout]:
    """Every cfg x sp x tp of one node's devices, data replicas over the rest (and across nodes)."""
    per_node, n = topology.devices_per_node, topology.num_devices
    out = []
    for cfg in ((1, 2) if guided else (1,)):
        for sp in range(1, per_node + 1):
            for tp in range(1, per_node + 1):
                group = cfg * sp * tp
                if per_node % group == 0 and n % group == 0:
                    out.append(VideoLayout(n // group, cfg, sp, tp))
    return out


def plan_video(config, topology: Topology, profile: VideoProfile, cached: bool = True,
               fixed: VideoLayout | None = None) -> list[VideoPrice]:
    """The layouts (or the one given), priced; ranked: those that fit by seconds a video, then the rest."""
    from xlaopt.families import family_of

    if not family_of(config).generates_video:
        raise UserError(f"--serve video prices a text-to-video request; {config.name} has no generator "
                        f"(serve it with --serve decode)")
    eff = cm.serving_efficiency(topology)
    hbm = topology.device.hbm_bytes
    out = []
    for layout in ([fixed] if fixed is not None else layouts(topology, profile.guided)):
        why = _why_not(config, layout, profile)
        if why and fixed is None:
            continue
        if why:
            raise UserError(f"--mesh {layout.mesh}: {why}")
        p = price_video(config, profile, layout, topology, eff, cached)
        if hbm > 0 and p.memory_bytes > hbm:
            p = dataclasses.replace(p, reason=f"needs {p.memory_bytes / 2**30:,.1f} GiB per device of "
                                              f"{hbm / 2**30:,.1f}")
        out.append(p)
    return sorted(out, key=lambda p: (bool(p.reason), p.seconds, -p.videos_per_s))


def layout_of_mesh(spec: MeshSpec, guided: bool) -> VideoLayout:
    """A fixed mesh as a layout: its data axis covers the branches first (cfg), then replicas."""
    if spec.size("fsdp") > 1 or spec.size("stage") > 1:
        raise UserError(f"--mesh {spec}: a video serving layout is data (cfg parallel, then replicas) x context "
                        f"(Ulysses) x tensor; fsdp and stage are training layouts")
    data = spec.size("data")
    cfg = 2 if guided and data % 2 == 0 else 1
    return VideoLayout(data // cfg, cfg, spec.size("context"), spec.size("tensor"))


def describe(profile: VideoProfile, config) -> str:
    t, h, w = profile.latent_grid(config.patch_size)
    return (f"{profile.resolution} ({profile.tier.width}x{profile.tier.height}), {profile.frames} frames at "
            f"{profile.fps} fps = {t} x {h} x {w} = {t * h * w:,} generator tokens; {profile.steps} steps, guidance "
            f"{profile.guidance:g}; text {' + '.join(f'{x:,}' for x in profile.branch_text_tokens())} tokens")


def format_video(config, topology: Topology, profile: VideoProfile, ranked: list[VideoPrice], rows: int = 12) -> str:
    sampler = "prompt K/V cached" if ranked and ranked[0].cached else "joint sequence every step"
    lines = [f"serve {config.name} text-to-video on {topology.name} ({topology.num_devices} devices), analytic, bf16, "
             f"{sampler}", f"  {describe(profile, config)}",
             f"  {'layout':<22}{'s/video':>9}{'/min':>6}{'step s':>8}{'matmul':>8}{'attn':>8}{'tp':>7}{'sp':>6}{'vae':>6}"
             f"{'GiB/dev':>9}  reason"]
    best = next((p for p in ranked if not p.reason), None)
    for p in ranked[:rows]:
        s = p.parts
        reason = p.reason or ("best" if p is best else f"{p.seconds / best.seconds:.2f}x the best's time")
        lines.append(f"  {p.layout.name:<22}{p.seconds:>9.1f}{60 * p.videos_per_s:>6.2f}{p.step_s:>8.2f}{s['matmuls']:>8.1f}{s['attention']:>8.1f}"
                     f"{s['tp']:>7.1f}{s['sp']:>6.1f}{s['vae']:>6.1f}{p.memory_bytes / 2**30:>9.1f}  {reason}")
    if len(ranked) > rows:
        lines.append(f"  ... {len(ranked) - rows} more (--rows)")
    lines.append("  seconds: the prompt, every step and the VAE decode on one device; tokenizing and writing the "
                 "video are not priced")
    return "\n".join(lines)


def request_report(config, profile: VideoProfile) -> dict:
    return {**dataclasses.asdict(profile), "gen_tokens": profile.gen_tokens(config.patch_size),
            "latent_grid": profile.latent_grid(config.patch_size)}


def report(config, profile: VideoProfile, ranked: list[VideoPrice]) -> dict:
    return {"request": request_report(config, profile),
            "includes": ["prompt (cached sampler: once)", "denoising steps, both guidance branches", "VAE decode"],
            "excludes": ["tokenizing the prompt", "encoding and writing the video"],
            "candidates": [{"layout": dataclasses.asdict(p.layout), "mesh": p.layout.mesh.as_dict(),
                            "name": p.layout.name, "cached": p.cached, "seconds_per_video": p.seconds,
                            "videos_per_s": p.videos_per_s, "step_s": p.step_s, "parts": p.parts,
                            "memory_bytes": p.memory_bytes, "reason": p.reason} for p in ranked]}

"""Cosmos 3 text-to-video requests priced whole (`plan --serve video`, `analyze --serve video`):
the tokens a clip becomes, the VAE decoder's work, and how each layout's price moves."""
from __future__ import annotations

import json

import pytest

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.topology import parse_topology
from xlaopt.cli import main
from xlaopt.errors import UserError
from xlaopt.inference.video_profile import TIERS, VideoProfile
from xlaopt.models.registry import get_config
from xlaopt.planning import serving_video as sv
from xlaopt.planning.vae_cost import decoder_flops

NANO = get_config("cosmos3-nano")


@pytest.mark.parametrize("tier, grid", [("720p", (48, 23, 40)), ("480p", (48, 15, 26)), ("256p", (48, 6, 10))])
def test_a_clip_is_the_tokens_nvidias_pipeline_makes(tier, grid):
    """cosmos-framework's own statement: a 720x1280 frame is a 45x80 latent, 23x40 = 920 tokens
    (the odd height padded to a patch), and 189 frames are 1 + 188 / 4 = 48 latent frames."""
    profile = VideoProfile(resolution=tier)
    assert (TIERS[tier].width, TIERS[tier].height) == {"720p": (1280, 720), "480p": (832, 480),
                                                       "256p": (320, 192)}[tier]
    assert profile.latent_grid(NANO.patch_size) == grid
    assert profile.gen_tokens(NANO.patch_size) == grid[0] * grid[1] * grid[2]


def test_the_vae_decoder_is_counted_conv_by_conv():
    """One latent frame of one latent pixel, counted by hand, layer by layer: the architecture
    in `vae_cost`'s docstring (time stays 1 frame: 1 + 2 * 0)."""
    k3 = 27
    rb = lambda cin, cout, n: 2 * n * (k3 * cin * cout + k3 * cout * cout + (cin * cout if cin != cout else 0))  # noqa: E731
    expected = (2 * k3 * 48 * 1024                                            # conv_in
                + 2 * rb(1024, 1024, 1) + 2 * 1 * 4 * 1024 * 1024 + 4 * 1024  # middle: blocks, attention on 1 pixel
                + 3 * rb(1024, 1024, 1) + 2 * 3 * 1024 * 2048 + 2 * 4 * 9 * 1024 * 1024      # level 0 at 1 px -> 2x2
                + 3 * rb(1024, 1024, 4) + 2 * 4 * 3 * 1024 * 2048 + 2 * 16 * 9 * 1024 * 1024  # level 1 -> 4x4
                + rb(1024, 512, 16) + 2 * rb(512, 512, 16) + 2 * 64 * 9 * 512 * 512           # level 2 -> 8x8
                + rb(512, 256, 64) + 2 * rb(256, 256, 64)                                    # level 3
                + 2 * 64 * k3 * 256 * 12)                                                     # head
    assert decoder_flops(1, 1, 1).flops == expected
    # Calls a latent frame: conv_in 1, middle 4 + attention 2, levels 8, 8, 8 and 7 (six block
    # convs each, the two width changes' shortcuts, five upsampling convs in time or space), head 1.
    assert decoder_flops(1, 1, 1).calls == 39 and decoder_flops(48, 45, 80).calls == 39 * 48
    # A clip: time doubles twice (48 latent frames decode to 189), the full-resolution levels dominate.
    clip = decoder_flops(48, 45, 80)
    assert clip.largest == "level2" and 3.0e15 < clip.flops < 3.5e15


def test_the_reference_layout_is_cfg_then_ulysses():
    """NVIDIA's `latency` preset: cfg = min(2, devices), context parallel over the rest, no tensor."""
    assert sv.reference_layout(1) == sv.VideoLayout(1, 1, 1, 1)
    assert sv.reference_layout(4) == sv.VideoLayout(1, 2, 2, 1)
    assert sv.reference_layout(8) == sv.VideoLayout(1, 2, 4, 1)
    assert sv.reference_layout(8).mesh.as_dict() == {"stage": 1, "data": 2, "fsdp": 1, "tensor": 1, "context": 4}


def _price(layout, topology="h200:1x8", cached=True):
    top = parse_topology(topology)
    return sv.price_video(NANO, VideoProfile(), layout, top, cm.serving_efficiency(top), cached)


def test_layouts_move_the_price_the_way_their_work_splits():
    one = _price(sv.VideoLayout(1, 1, 1, 1), "h200:1x1")
    cfg = _price(sv.VideoLayout(1, 2, 1, 1), "h200:1x2")
    # CFG parallel: each group runs one branch, the slower (the negative prompt is longer).
    assert cfg.parts["matmuls"] == pytest.approx(one.parts["matmuls"] / 2, rel=0.05)
    assert cfg.parts["attention"] == pytest.approx(one.parts["attention"] / 2, rel=0.05)
    # Ulysses moves a fraction of what tensor parallelism's all-reduces move, and replicates weights.
    sp8, tp8 = _price(sv.VideoLayout(1, 1, 8, 1)), _price(sv.VideoLayout(1, 1, 1, 8))
    assert 0 < sp8.parts["sp"] < tp8.parts["tp"] / 5 and sp8.parts["tp"] == tp8.parts["sp"] == 0
    assert sp8.memory_bytes > 4 * tp8.memory_bytes
    # The decode runs on one device whatever the layout; caching the prompt saves work every step.
    assert sp8.parts["vae"] == tp8.parts["vae"] == one.parts["vae"] > 0
    uncached = _price(sv.VideoLayout(1, 1, 8, 1), cached=False)
    assert uncached.seconds > sp8.seconds and uncached.parts["prompt"] == 0 < sp8.parts["prompt"]


def test_the_planner_serves_super_on_8_h200_without_tensor_parallel_and_refuses_what_does_not_fit():
    ranked = sv.plan_video(get_config("cosmos3-super"), parse_topology("h200:1x8"), VideoProfile())
    best = ranked[0]
    assert not best.reason and best.layout.tp < 8 and best.layout.data == 1
    tp8 = next(p for p in ranked if p.layout == sv.VideoLayout(1, 1, 1, 8))
    assert tp8.seconds > best.seconds
    # Whole weights on every device (Ulysses) do not fit an 80 GB H100: 64B parameters in bf16.
    on_h100 = sv.plan_video(get_config("cosmos3-super"), parse_topology("h100:1x8"), VideoProfile())
    sp8 = next(p for p in on_h100 if p.layout == sv.VideoLayout(1, 1, 8, 1))
    assert "GiB per device" in sp8.reason and not on_h100[0].reason and on_h100[0].layout.tp > 1


def test_profile_refusals_name_the_fix():
    with pytest.raises(UserError, match="4k\\+1 frames"):
        VideoProfile(frames=188)
    with pytest.raises(UserError, match="256p, 480p, 720p"):
        VideoProfile(resolution="4k")
    with pytest.raises(UserError, match="at most 300 frames"):
        VideoProfile(resolution="480p", frames=301)


def test_plan_serve_video_writes_seconds_per_video(tmp_path, capsys):
    out = tmp_path / "video.json"
    assert main(["plan", "--model", "cosmos3-nano", "--topology", "h200:1x8", "--serve", "video", "--resolution",
                 "720p", "--frames", "189", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["request"]["gen_tokens"] == 44160 and r["request"]["steps"] == 35 and r["request"]["guidance"] == 6.0
    best = r["candidates"][0]
    assert best["seconds_per_video"] == pytest.approx(sum(best["parts"].values()))
    assert "VAE decode" in r["includes"] and "s/video" in capsys.readouterr().out
    fixed = tmp_path / "fixed.json"
    assert main(["plan", "--model", "cosmos3-nano", "--topology", "h200:1x8", "--serve", "video", "--mesh",
                 "data=2,context=4", "--no-prompt-cache", "--json", str(fixed)]) == 0
    (only,) = json.loads(fixed.read_text())["candidates"]
    assert only["name"] == "cfg2 x sp4" and not only["cached"]


def test_analyze_serve_video_prices_the_compiled_step_times_the_steps(tmp_path):
    """cosmos3-tiny, the guidance branches split over data=2 (CFG parallel) and each row's positions
    over context=2 (Ulysses), compiled for the CPU: the request is the steps times the compiled
    step, plus the prompt and the decode."""
    out = tmp_path / "video.json"
    assert main(["analyze", "--model", "cosmos3-tiny", "--set", "num_layers=1", "--topology", "h100:1x8", "--mesh",
                 "data=2,context=2", "--target", "cpu", "--serve", "video", "--resolution", "256p", "--frames", "5",
                 "--steps", "3", "--prompt-tokens", "16", "--negative-tokens", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["layout"] == "cfg2 x sp2" and r["gen"] == 2 * 6 * 10 and r["text"] == 16
    assert r["parts"]["steps"] == pytest.approx(3 * r["cached"]["step_time_s"]) and r["cached"]["step_time_s"] > 0
    assert r["seconds_per_video"] == pytest.approx(sum(r["parts"].values()))


def test_a_serving_steps_cudnn_attention_gets_its_flops_by_name_scope():
    """XLA counts no FLOPs for cuDNN's fused attention; a serving step's calls are found by the
    name scope the model traces them under (L queries over S keys) and given 4 H K L S a row."""
    from xlaopt.models.cudnn_attention import FORWARD_TARGET, fused_tag
    from xlaopt.planning.serving_step import fused_attention_flops

    hlo = (f'%fmha = custom-call(%q, %k, %v), custom_call_target="{FORWARD_TARGET}", '
           f'metadata={{op_name="jit(step)/{fused_tag(180, 244)}/attention"}}')
    assert fused_attention_flops(hlo, heads=8, head_dim=32, rows=2) == {
        fused_tag(180, 244): {FORWARD_TARGET: 4.0 * 8 * 32 * 2 * 180 * 244}}
    assert fused_attention_flops("no attention here", 8, 32, 2) == {}


def test_a_video_step_compiles_for_b200(tmp_path):
    """The B200 target config (sm_100) compiles a guided step deviceless, cuDNN attention included,
    as the published B200 rows are priced in BENCHMARKS.md."""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    out = tmp_path / "b200.json"
    assert main(["analyze", "--model", "cosmos3-tiny", "--set", "num_layers=1", "--topology", "b200:1x2", "--mesh",
                 "data=2", "--target", "gpu", "--serve", "video", "--resolution", "256p", "--frames", "5", "--steps",
                 "2", "--prompt-tokens", "16", "--negative-tokens", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["target"] == "gpu" and r["cached"]["step_time_s"] > 0 and r["layout"] == "cfg2"

"""Rectified-flow sampling of Cosmos 3's generator with the reasoner's K/V cached
(`xlaopt.inference.sample_cosmos`) against the model's own training forward pass: cached
velocities and whole samples equal the uncached ones, guidance in one batch equals the two
branches apart, the reasoner runs once per prompt, and bad input is refused; plus
`xlaopt generate` end to end."""
import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.cli import main
from xlaopt.errors import UserError
from xlaopt.inference import sample_cosmos as sc
from xlaopt.inference.flow_schedule import FlowSchedule, sample
from xlaopt.models import cosmos3
from xlaopt.models.cosmos3 import VIDEO, Cosmos3
from xlaopt.models.decoder import Decoder
from xlaopt.models.registry import get_config

B, TEXT, GEN, GUIDANCE = 2, 16, 32, 3.0
EDGE = dict(reasoner_qk_norm=False, reasoner_key_norm_for_generator=True, mlp_activation="relu2")
# Float32 velocities of magnitude <= ~5 (ulp ~5e-7). The cached path computes the same ops as the
# full forward pass, only regrouped (the reasoner's layers in a scan of their own, its keys and
# values concatenated from a cache), so XLA may fuse and tile the dots differently: a few ulps
# per layer, measured 0 (bitwise) for one velocity here and <= 3e-6 on whole samples. 1e-5 stays
# 500x under the smallest fault tried by hand (a step's sigma off by 0.01: 5e-3; the Edge side
# key norm skipped: 0.16; text positions off by one: 0.23; branch rows' caches swapped: 1.8).
VELOCITY_ATOL = 1e-5
# Guidance multiplies a velocity error by up to 2g - 1 = 5 (g (e_c - e_u) + e_u), and a sample
# integrates 10 such velocities over sigma 1 -> 0 (the steps' dt sum to 1, errors compounding
# through the model at most by its O(1) Lipschitz factor per step): 1e-4 covers 5 x 1e-5 x 2.
SAMPLE_ATOL = 1e-4
GUIDED_ATOL = (2 * GUIDANCE - 1) * VELOCITY_ATOL


def setup(overrides: dict) -> dict:
    config = get_config("cosmos3-tiny", dict(num_layers=2, **overrides))
    model = Cosmos3(config, jnp.float32)
    rng = np.random.default_rng(5)
    # Ragged prompts: row 1 is padded, so padding's invisibility to the generator is exercised.
    prompts = [rng.integers(0, config.vocab_size, TEXT), rng.integers(0, config.vocab_size, TEXT - 5)]
    request = sc.video_request(config, prompts, TEXT, sc.clip_grid(GEN), GUIDANCE)
    batch = {k: jnp.asarray(v) for k, v in request.batch.items()}
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch))["params"]
    x_RVC = jax.random.normal(jax.random.key(1), batch["gen_x0_BVC"].shape, jnp.float32)
    return dict(config=config, model=model, request=request, batch=batch, params=params, x_RVC=x_RVC,
                prefill=jax.jit(lambda p, b: sc.reasoner_kv(model, p, b)),
                cached=jax.jit(lambda p, b, x, s, c: sc.generator_velocity(model, p, b, x, s, c)),
                uncached=jax.jit(lambda p, b, x, s: sc.uncached_velocity(model, p, b, x, s)))


@functools.cache
def variant_named(name: str) -> dict:
    return setup({} if name == "standard" else EDGE)


@pytest.fixture(scope="module", params=["standard", "edge"])
def variant(request):
    return variant_named(request.param)


@pytest.fixture(scope="module")
def standard():
    return variant_named("standard")


def test_request_lays_out_rows_as_the_producer_does(standard):
    c, r = standard["config"], standard["request"]
    batch = r.batch
    assert r.grid == (4, 2, 4) and batch["text_tokens_BT"].shape == (2 * B, TEXT)
    # Conditional rows, then the unconditional ones: the null prompt (one token) and padding.
    np.testing.assert_array_equal(batch["text_segment_ids_BT"][:B, :TEXT - 5], 1)
    np.testing.assert_array_equal(batch["text_segment_ids_BT"][1, TEXT - 5:], 0)
    np.testing.assert_array_equal(batch["text_segment_ids_BT"][B:], [[1] + [0] * (TEXT - 1)] * B)
    np.testing.assert_array_equal(batch["text_tokens_BT"][B:, 0], sc.NULL_PROMPT[0])
    assert (batch["gen_segment_ids_BV"] == 1).all() and (batch["gen_modality_BV"] == VIDEO).all()
    assert batch["gen_noisy_BV"].all()
    # Each row's clip starts after its own prompt plus the temporal margin; (h, w) run over the grid.
    for row, n_text in enumerate([TEXT, TEXT - 5, 1, 1]):
        assert batch["gen_positions_3BV"][0, row, 0] == n_text + c.temporal_margin
    np.testing.assert_array_equal(batch["gen_positions_3BV"][1:, 0, :8], [[0, 0, 0, 0, 1, 1, 1, 1],
                                                                          [0, 1, 2, 3, 0, 1, 2, 3]])


@pytest.mark.parametrize("sigma", [1.0, 0.6, 0.05])
def test_cached_velocity_equals_the_full_forward(variant, sigma):
    v = variant
    cache = v["prefill"](v["params"], v["batch"])
    L, R = v["config"].num_layers, 2 * B
    assert cache.k_LBTNK.shape == cache.v_LBTNK.shape == (L, R, TEXT, v["config"].num_kv_heads, v["config"].head_dim)
    cached = v["cached"](sc.generator_params(v["params"]), v["batch"], v["x_RVC"], sigma, cache)
    full = v["uncached"](v["params"], v["batch"], v["x_RVC"], sigma)
    assert float(jnp.abs(full).max()) > 0.5  # a real prediction, not zeros on both sides
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=0, atol=VELOCITY_ATOL)


def test_edge_variant_reads_side_normed_keys(standard):
    """The Edge config's generator reads the reasoner keys through the side norm: the cache holds
    those keys, not the ones the reasoner's own queries read."""
    v = variant_named("edge")
    assert "side_k_norm" in v["params"]["layers"]["reasoner"]
    assert "side_k_norm" not in standard["params"]["layers"]["reasoner"]
    no_side_norm = {**EDGE, "reasoner_key_norm_for_generator": False}
    plain = Cosmos3(get_config("cosmos3-tiny", dict(num_layers=2, **no_side_norm)), jnp.float32)
    k_plain = jax.jit(lambda p, b: sc.reasoner_kv(plain, p, b))(v["params"], v["batch"]).k_LBTNK
    k_gen = v["prefill"](v["params"], v["batch"]).k_LBTNK
    assert float(jnp.abs(k_gen - k_plain).max()) > 0.1


def test_velocity_reads_the_prompt(standard):
    """Guards the equality above against a generator that ignores the text: another prompt (same
    shapes, so the same executables) moves the velocity."""
    s = standard
    other = dict(s["batch"], text_tokens_BT=(s["batch"]["text_tokens_BT"] + 1) % s["config"].vocab_size)
    cache, cache_other = s["prefill"](s["params"], s["batch"]), s["prefill"](s["params"], other)
    gen = sc.generator_params(s["params"])
    v, v_other = (s["cached"](gen, s["batch"], s["x_RVC"], 0.5, c) for c in (cache, cache_other))
    assert float(jnp.abs(v - v_other).max()) > 1e-2


def test_guidance_in_one_batch_equals_the_branches_apart(standard):
    s = standard
    gen, x_BVC, sigma = sc.generator_params(s["params"]), s["x_RVC"][:B], 0.4
    cache = s["prefill"](s["params"], s["batch"])
    both = sc.guided(lambda x: s["cached"](gen, s["batch"], x, sigma, cache), x_BVC, GUIDANCE, cfg=True)
    branches = []
    for rows in ((0, B), (B, 2 * B)):
        part = sc.rows_of(s["batch"], *rows)
        branches.append(s["cached"](gen, part, x_BVC, sigma, s["prefill"](s["params"], part)))
    v_cond, v_uncond = branches
    assert float(jnp.abs(v_cond - v_uncond).max()) > 1e-2  # the null prompt is a different condition
    np.testing.assert_allclose(np.asarray(both), np.asarray(v_uncond + GUIDANCE * (v_cond - v_uncond)),
                               rtol=0, atol=GUIDED_ATOL)


@pytest.fixture(scope="module")
def sampler(standard):
    return sc.CosmosSampler(standard["model"])


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0])
def test_cached_sample_equals_uncached(standard, sampler, guidance):
    s = standard
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, s["config"].vocab_size, TEXT), rng.integers(0, s["config"].vocab_size, TEXT - 5)]
    request = sc.video_request(s["config"], prompts, TEXT, sc.clip_grid(GEN), guidance)
    assert request.cfg == (guidance != 1.0)
    assert request.batch["text_tokens_BT"].shape[0] == (2 * B if request.cfg else B)
    x_T = request.noise(s["config"], jax.random.key(2))
    schedule = FlowSchedule(10, shift=3.0)
    cached = sampler.sample(s["params"], request, x_T, schedule, order=1, cached=True)
    uncached = sampler.sample(s["params"], request, x_T, schedule, order=1, cached=False)
    assert cached.x0_BVC.shape == (B, GEN, s["config"].generator_in_dim)
    assert cached.stats["model_calls"] == uncached.stats["model_calls"] == 10
    assert len(cached.stats["step_s"]) == 10 and cached.stats["compile_s"] > 0
    assert float(np.abs(cached.x0_BVC - x_T).max()) > 0.1  # the sample moved away from the noise
    np.testing.assert_allclose(cached.x0_BVC, uncached.x0_BVC, rtol=0, atol=SAMPLE_ATOL)


def test_timed_loop_is_flow_schedules_sample(standard):
    """`integrate` (timed step by step) is `flow_schedule.sample`, bit for bit, Euler and Heun."""
    s = standard
    gen, cache = sc.generator_params(s["params"]), s["prefill"](s["params"], s["batch"])
    velocity = lambda x, sigma: s["cached"](gen, s["batch"], x, sigma, cache)
    schedule = FlowSchedule(3, shift=3.0)
    for order, calls in ((1, 3), (2, 5)):
        n = [0]

        def counted(x, sigma, n=n):
            n[0] += 1
            return velocity(x, sigma)

        x0, step_s = sc.integrate(counted, s["x_RVC"], schedule, order)
        assert len(step_s) == 3 and n[0] == calls
        np.testing.assert_array_equal(np.asarray(x0), np.asarray(sample(velocity, s["x_RVC"], schedule, order)))


def test_reasoner_kv_is_computed_once_per_prompt(standard, monkeypatch):
    """Traced once (one executable), run once per sample; the per-step executable gets neither the
    reasoner's weights nor the text, so it cannot recompute them."""
    s = standard
    traced, prefills = [0], [0]
    real_kv = cosmos3.reasoner_kv

    def counting_kv(*a, **k):
        traced[0] += 1  # a Python side effect: runs once per trace, never per execution
        return real_kv(*a, **k)

    monkeypatch.setattr(cosmos3, "reasoner_kv", counting_kv)
    fresh = sc.CosmosSampler(s["model"])
    real_prefill = fresh.prefill

    def counting_prefill(*a):
        prefills[0] += 1
        return real_prefill(*a)

    monkeypatch.setattr(fresh, "prefill", counting_prefill)
    x_T = s["request"].noise(s["config"], jax.random.key(3))
    for _ in range(2):
        out = fresh.sample(s["params"], s["request"], x_T, FlowSchedule(4), cached=True)
        assert out.stats["model_calls"] == 4
    assert traced[0] == 1 and prefills[0] == 2
    step_keys = [k for k in fresh._compiled if k[0] == ("cached", True)]
    assert len(step_keys) == 1
    step_params = sc.generator_params(s["params"])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(step_params)]
    assert paths and not any("reasoner" in p or "embed_ED" in p or "lm_head" in p for p in paths)
    assert "text_tokens_BT" not in sc.GEN_FIELDS


@pytest.mark.parametrize("guidance", [0.5, 20.5, float("nan"), float("inf"), True, "3"])
def test_guidance_out_of_range_is_refused(standard, guidance):
    with pytest.raises(UserError, match="guidance"):
        sc.video_request(standard["config"], [np.arange(4)], TEXT, (1, 2, 2), guidance)


def test_bad_requests_are_refused(standard):
    c = standard["config"]
    with pytest.raises(UserError, match="does not fit"):
        sc.video_request(c, [np.arange(TEXT + 1)], TEXT, (1, 2, 2))
    with pytest.raises(UserError, match="vocabulary"):
        sc.video_request(c, [np.array([c.vocab_size])], TEXT, (1, 2, 2))
    with pytest.raises(UserError, match="divisor"):
        sc.clip_grid(30, frames=4)
    with pytest.raises(UserError, match="Cosmos 3"):
        sc.CosmosSampler(Decoder(get_config("llama-tiny", dict(num_layers=1)), jnp.float32))
    with pytest.raises(UserError, match="order"):
        sc.integrate(lambda x, s: x, jnp.zeros(2), FlowSchedule(2), order=3)


TINY = ["--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128", "--set", "num_heads=4",
        "--set", "num_kv_heads=2"]


def test_cli_generate_video_writes_the_report(tmp_path, capsys):
    out = tmp_path / "gen.json"
    assert main(["generate", "--model", "cosmos3-tiny", *TINY, "--batch-size", "2", "--prompt-len", "8",
                 "--gen-len", "16", "--steps", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("model", "mode", "output_shapes", "compile_s", "wall_per_step_s", "speedup_vs_uncached",
                "max_abs_diff_vs_uncached"):
        assert key in r, key
    assert r["mode"] == "video" and r["cfg"] and r["rows_per_step"] == 4
    assert r["output_shapes"]["latents_BVC"][:2] == [2, 16]
    assert r["max_abs_diff_vs_uncached"] <= SAMPLE_ATOL
    assert "ms/step" in capsys.readouterr().out


def test_cli_generate_text_on_a_decoder(tmp_path):
    out = tmp_path / "gen.json"
    assert main(["generate", "--model", "llama-tiny", *TINY, "--prompt-len", "6", "--new-tokens", "4",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "text" and r["output_shapes"]["tokens_BN"] == [1, 4] and len(r["tokens"][0]) == 4


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-tiny", "--guidance", "3"], "no generator"),
    (["--model", "vit-tiny"], "no generator to sample"),
    (["--model", "cosmos3-tiny", "--guidance", "25"], "guidance"),
    (["--model", "cosmos3-tiny", "--steps", "0"], "steps"),
    (["--model", "cosmos3-tiny", "--prompt-len", "20", "--text-len", "16"], "does not fit"),
    (["--model", "cosmos3-tiny", "--new-tokens", "3"], "--decode-text"),
])
def test_cli_generate_bad_input_is_one_line(args, message, capsys):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err

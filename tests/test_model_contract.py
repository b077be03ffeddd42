"""The model's contract: one-way flow, sample isolation, mRoPE layout, timestep placement."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.data.packing import generator_positions
from xlaopt.models import mrope
from xlaopt.models.attention import AttentionSpec
from xlaopt.models.cosmos3 import ACTION, SOUND, VIDEO, Cosmos3
from xlaopt.models.masks import two_way_mask
from xlaopt.models.objective import noised_inputs


@pytest.fixture(scope="module", params=["dense", "segment"])
def model_and_params(tiny_config, synthetic_batch, request):
    """The contract holds for every attention that trains: dense masked, and segment-aware (which
    skips the block pairs the mask forbids, per row)."""
    model = Cosmos3(tiny_config, attention=AttentionSpec(request.param, 16))  # bf16 compute, as trained
    batch = jax.tree.map(jnp.asarray, synthetic_batch)
    params = jax.jit(model.init)(jax.random.key(0), batch, batch["gen_x0_BVC"])["params"]
    apply = jax.jit(lambda p, b, x: model.apply({"params": p}, b, x))
    return apply, params


def _run(model_and_params, batch):
    apply, params = model_and_params
    batch = jax.tree.map(jnp.asarray, batch)
    x_t, _ = noised_inputs(batch, jax.random.normal(jax.random.key(1), batch["gen_x0_BVC"].shape))
    return jax.tree.map(np.asarray, apply(params, batch, x_t))


def test_reasoner_outputs_ignore_generator_tokens(model_and_params, synthetic_batch):
    logits, pred = _run(model_and_params, synthetic_batch)
    perturbed = dict(synthetic_batch)
    rng = np.random.default_rng(0)
    perturbed["gen_x0_BVC"] = synthetic_batch["gen_x0_BVC"] + rng.standard_normal(synthetic_batch["gen_x0_BVC"].shape).astype(np.float32)
    perturbed["gen_sigma_BV"] = rng.uniform(size=synthetic_batch["gen_sigma_BV"].shape).astype(np.float32)
    perturbed["gen_action_domain_BV"] = (synthetic_batch["gen_action_domain_BV"] + 1) % 4
    logits2, pred2 = _run(model_and_params, perturbed)
    np.testing.assert_array_equal(logits2, logits)  # bit-identical
    assert np.abs(pred2 - pred).max() > 1e-3  # the perturbation did reach the generator


def test_packed_samples_are_isolated(model_and_params, synthetic_batch):
    row, victim = 0, 2
    text_seg, gen_seg = synthetic_batch["text_segment_ids_BT"], synthetic_batch["gen_segment_ids_BV"]
    assert (text_seg[row] == victim).any() and (gen_seg[row] == victim).any()
    logits, pred = _run(model_and_params, synthetic_batch)
    perturbed = {k: v.copy() for k, v in synthetic_batch.items()}
    t_mask, g_mask = text_seg[row] == victim, gen_seg[row] == victim
    perturbed["text_tokens_BT"][row, t_mask] = (perturbed["text_tokens_BT"][row, t_mask] + 7) % 4096
    perturbed["gen_x0_BVC"][row, g_mask] += 1.5
    logits2, pred2 = _run(model_and_params, perturbed)
    others_t = np.ones_like(text_seg, bool)
    others_t[row] = ~t_mask
    others_g = np.ones_like(gen_seg, bool)
    others_g[row] = ~g_mask
    np.testing.assert_array_equal(logits2[others_t], logits[others_t])
    np.testing.assert_array_equal(pred2[others_g], pred[others_g])
    assert np.abs(logits2[row, t_mask] - logits[row, t_mask]).max() > 1e-3
    assert np.abs(pred2[row, g_mask] - pred[row, g_mask]).max() > 1e-3


def test_timestep_embedding_touches_only_noisy_tokens(model_and_params, synthetic_batch):
    clean = (synthetic_batch["gen_segment_ids_BV"] > 0) & ~synthetic_batch["gen_noisy_BV"]
    assert clean.any(), "the synthetic batch should hold image-to-video conditioning frames"
    logits, pred = _run(model_and_params, synthetic_batch)
    changed = dict(synthetic_batch, gen_sigma_BV=np.where(clean, 0.987, synthetic_batch["gen_sigma_BV"]).astype(np.float32))
    logits2, pred2 = _run(model_and_params, changed)
    # sigma of clean tokens feeds nothing: no output anywhere moves.
    np.testing.assert_array_equal(pred2, pred)
    np.testing.assert_array_equal(logits2, logits)
    noisy = synthetic_batch["gen_noisy_BV"] & (synthetic_batch["gen_segment_ids_BV"] > 0)
    # Same inputs x_t, different sigma on noisy tokens: only the timestep embedding differs.
    apply, params = model_and_params
    batch = jax.tree.map(jnp.asarray, synthetic_batch)
    x_t, _ = noised_inputs(batch, jax.random.normal(jax.random.key(1), batch["gen_x0_BVC"].shape))
    moved = dict(batch, gen_sigma_BV=jnp.where(noisy, 0.5 * batch["gen_sigma_BV"], batch["gen_sigma_BV"]))
    _, pred_a = apply(params, batch, x_t)
    _, pred_b = apply(params, moved, x_t)
    assert np.abs(np.asarray(pred_a) - np.asarray(pred_b))[noisy].max() > 1e-3


def test_mrope_positions_hand_built_example(tiny_config):
    # A sample: 3 text tokens, then generator splits from the offset 3 + margin 15000.
    plain = dataclasses.replace(tiny_config, fps_modulation=False)
    text = mrope.text_positions(3)
    t0 = mrope.temporal_offset(3, 15000)
    video = generator_positions(VIDEO, (2, 2, 3), t0, 30.0, plain)
    action = generator_positions(ACTION, (4, 1, 1), t0, 30.0, plain)
    np.testing.assert_array_equal(text, [[0, 1, 2], [0, 1, 2], [0, 1, 2]])
    np.testing.assert_array_equal(video, [
        [15003] * 6 + [15004] * 6,
        [0, 0, 0, 1, 1, 1] * 2,
        [0, 1, 2, 0, 1, 2] * 2,
    ])
    # Actions start one frame in, on their own integer clock.
    np.testing.assert_array_equal(action, [[15004, 15005, 15006, 15007], [0] * 4, [0] * 4])


def test_mrope_positions_on_the_base_clock(tiny_config):
    # fps modulation (base 24 fps, 4 frames per latent step, sound latents at 25 Hz): one
    # position per latent frame of a 24 fps video; other clocks rescaled onto it.
    c = tiny_config
    assert c.fps_modulation and c.base_fps == 24 and c.sound_latent_fps == 25.0
    t = lambda m, n, fps: generator_positions(m, (n, 1, 1), 15003, fps, c)[0]
    np.testing.assert_array_equal(t(VIDEO, 3, 24.0), [15003, 15004, 15005])
    np.testing.assert_allclose(t(VIDEO, 3, 30.0), [15003, 15003.8, 15004.6], rtol=0, atol=1e-3)  # 7.5 steps/s
    np.testing.assert_allclose(t(SOUND, 3, None), [15003, 15003.96, 15004.92], rtol=0, atol=1e-3)
    np.testing.assert_allclose(t(ACTION, 4, 24.0), [15003.25, 15003.5, 15003.75, 15004], rtol=0, atol=1e-3)
    # An image (one latent frame) has no clock: integer time at the offset.
    assert generator_positions(VIDEO, (1, 2, 2), 15003, 30.0, c)[0].tolist() == [15003] * 4


def test_mrope_frequency_sections_are_interleaved():
    axes = mrope.frequency_axes((24, 20, 20))
    assert axes.shape == (64,)
    np.testing.assert_array_equal(np.flatnonzero(axes == 1), np.arange(1, 59, 3))
    np.testing.assert_array_equal(np.flatnonzero(axes == 2), np.arange(2, 60, 3))
    np.testing.assert_array_equal(np.flatnonzero(axes == 0), np.r_[np.arange(0, 60, 3), 60, 61, 62, 63])


def test_mrope_on_text_is_plain_rope():
    # With (p, p, p) positions every frequency sees p: mRoPE reduces to 1-D rotary.
    head_dim, theta = 32, 1e4
    p = np.arange(7)
    pos = np.broadcast_to(p, (3, 1, 7))
    cos, sin = mrope.rope_cos_sin(jnp.asarray(pos), head_dim, (6, 5, 5), theta)
    inv = 1.0 / theta ** (np.arange(16) * 2 / head_dim)
    ang = np.concatenate([p[:, None] * inv, p[:, None] * inv], -1)
    np.testing.assert_allclose(np.asarray(cos)[0], np.cos(ang), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin)[0], np.sin(ang), rtol=1e-5, atol=1e-6)


def test_two_way_mask_hand_built():
    # Sample 1: 2 text + 2 generator tokens; sample 2: 1 text + 1 generator; one padding token.
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 0]])
    gen = jnp.array([[0, 0, 1, 1, 0, 1, 0]], bool)
    expected = np.array([
        [1, 0, 0, 0, 0, 0, 0],  # text 1.0: itself
        [1, 1, 0, 0, 0, 0, 0],  # text 1.1: causal
        [1, 1, 1, 1, 0, 0, 0],  # gen 1: all of sample 1
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0],  # text 2.0
        [0, 0, 0, 0, 1, 1, 0],  # gen 2
        [0, 0, 0, 0, 0, 0, 1],  # padding: only itself
    ], bool)
    np.testing.assert_array_equal(np.asarray(two_way_mask(seg, gen))[0], expected)


def test_synthetic_batches_hold_every_modality(synthetic_batch):
    mods = set(np.unique(synthetic_batch["gen_modality_BV"][synthetic_batch["gen_segment_ids_BV"] > 0]))
    assert {VIDEO, ACTION} <= mods

"""Blockwise attention equals dense masked attention, and keeps the mask's guarantees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.models.attention import AttentionSpec, blockwise_or_dense, dense_attention
from xlaopt.models.cosmos3 import Cosmos3
from xlaopt.models.masks import Tokens
from xlaopt.models.objective import noised_inputs


def _inputs(S=50, L=20, B=2, H=4, N=2, K=16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, L, H, K)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, N, K)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, N, K)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 4, (B, S)), axis=1), jnp.int32)
    gen = jnp.asarray(rng.random((B, S)) < 0.5)
    keys = Tokens.of(seg, gen)
    return q, k, v, keys.slice(S - L, S), keys


@pytest.mark.parametrize("block", [7, 16, 50])
def test_blockwise_matches_dense_values_and_gradients(block):
    q, k, v, q_tok, k_tok = _inputs()
    dense = lambda q, k, v: dense_attention(q, k, v, q_tok, k_tok)
    blockwise = lambda q, k, v: blockwise_or_dense(q, k, v, q_tok, k_tok, block)
    np.testing.assert_allclose(blockwise(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for g_b, g_d in zip(jax.grad(loss(blockwise), (0, 1, 2))(q, k, v), jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_b, g_d, rtol=1e-4, atol=1e-5)


def test_blockwise_model_keeps_samples_isolated(tiny_config, synthetic_batch):
    model = Cosmos3(tiny_config, jnp.float32, attention=AttentionSpec("blockwise", 32))
    dense = Cosmos3(tiny_config, jnp.float32)
    batch = jax.tree.map(jnp.asarray, synthetic_batch)
    params = model.init(jax.random.key(0), batch)["params"]
    x_t, _ = noised_inputs(batch, jax.random.normal(jax.random.key(1), batch["gen_x0_BVC"].shape))
    run = jax.jit(lambda m, b: m.apply({"params": params}, b, x_t), static_argnums=0)
    logits, pred = run(model, batch)
    logits_d, pred_d = run(dense, batch)
    np.testing.assert_allclose(logits, logits_d, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pred, pred_d, rtol=1e-4, atol=1e-4)
    # Change one sample's text: every other token's outputs stay bit-identical.
    victim = np.asarray(batch["text_segment_ids_BT"][0]) == 2
    tokens = np.asarray(batch["text_tokens_BT"]).copy()
    tokens[0, victim] = (tokens[0, victim] + 3) % tiny_config.vocab_size
    logits2, pred2 = run(model, dict(batch, text_tokens_BT=jnp.asarray(tokens)))
    others = np.asarray(batch["gen_segment_ids_BV"][0]) != 2
    np.testing.assert_array_equal(np.asarray(pred2)[0, others], np.asarray(pred)[0, others])
    np.testing.assert_array_equal(np.asarray(logits2)[1:], np.asarray(logits)[1:])
    assert np.abs(np.asarray(pred2)[0, ~others] - np.asarray(pred)[0, ~others]).max() > 1e-4

"""Blockwise attention equals dense masked attention, and keeps the mask's guarantees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.models.attention import AttentionSpec, blockwise_or_dense, dense_attention, segment_attention
from xlaopt.models.cosmos3 import Cosmos3
from xlaopt.models.masks import Tokens, pair_mask
from xlaopt.models.objective import noised_inputs
from xlaopt.models.segment_attention import pair_counts, row_block_pairs


def _inputs(S=50, L=20, B=2, H=4, N=2, K=16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, L, H, K)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, N, K)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, N, K)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 4, (B, S)), axis=1), jnp.int32)
    gen = jnp.asarray(rng.random((B, S)) < 0.5)
    keys = Tokens.of(seg, gen)
    return q, k, v, keys.slice(S - L, S), keys


@pytest.mark.parametrize("impl", [blockwise_or_dense, segment_attention])
@pytest.mark.parametrize("block", [7, 16, 50])
def test_blockwise_matches_dense_values_and_gradients(impl, block):
    q, k, v, q_tok, k_tok = _inputs()
    dense = lambda q, k, v: dense_attention(q, k, v, q_tok, k_tok)
    blockwise = lambda q, k, v: impl(q, k, v, q_tok, k_tok, block)
    np.testing.assert_allclose(blockwise(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for g_b, g_d in zip(jax.grad(loss(blockwise), (0, 1, 2))(q, k, v), jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_b, g_d, rtol=1e-4, atol=1e-5)


def test_block_pairs_cover_every_pair_the_mask_allows_and_skip_the_rest(tiny_config, synthetic_batch):
    """Per row, the listed block pairs are a superset of those the two-way mask needs (so skipping
    the rest is exact), and on rows of block-aligned samples they are exactly those pairs."""
    T = synthetic_batch["text_segment_ids_BT"].shape[1]
    segment = np.concatenate([synthetic_batch["text_segment_ids_BT"], synthetic_batch["gen_segment_ids_BV"]], 1)
    is_gen = np.concatenate([np.zeros_like(synthetic_batch["text_segment_ids_BT"], bool),
                             np.ones_like(synthetic_batch["gen_segment_ids_BV"], bool)], 1)
    tokens = Tokens.of(jnp.asarray(segment), jnp.asarray(is_gen))
    block = 16
    for q, k in ((tokens.slice(0, T), tokens.slice(0, T)), (tokens.slice(T, segment.shape[1]), tokens)):
        needed = np.asarray(row_block_pairs(q, k, block))
        allowed = np.asarray(pair_mask(q, k))  # [B, L, S]
        B, L, S = allowed.shape
        by_block = allowed.reshape(B, L // block, block, S // block, block).any(axis=(2, 4))
        assert np.all(needed[by_block]), "a pair the mask allows would be skipped"
    # Rows of 8 samples, each 8 text tokens and 16 generator tokens, in blocks of 8: the reasoner
    # computes only its diagonal blocks; each generator block its sample's text block and its own
    # two generator blocks. The second row packs the same samples shifted by half a block, which
    # only it pays for: rows are scheduled one by one.
    seg_T, seg_V = np.repeat(np.arange(1, 9), 8), np.repeat(np.arange(1, 9), 16)
    aligned = np.concatenate([seg_T, seg_V])
    shifted = np.concatenate([np.r_[np.zeros(4, int), seg_T[:-4]], np.r_[np.zeros(8, int), seg_V[:-8]]])
    rows = Tokens.of(jnp.asarray(np.stack([aligned, shifted])),
                     jnp.asarray(np.tile(np.r_[np.zeros(64, bool), np.ones(128, bool)], (2, 1))))
    reasoner = np.asarray(row_block_pairs(rows.slice(0, 64), rows.slice(0, 64), 8))
    np.testing.assert_array_equal(reasoner[0], np.eye(8, dtype=bool))
    generator = np.asarray(row_block_pairs(rows.slice(64, 192), rows, 8))
    assert generator.shape == (2, 16, 24) and generator[0].sum() == 16 * 3
    assert all(generator[0, b, b // 2] and generator[0, b, 8 + 2 * (b // 2)] and generator[0, b, 9 + 2 * (b // 2)]
               for b in range(16))
    counts = pair_counts(rows.slice(64, 192), rows, 8)
    assert counts[0] == 48 and counts[1] > counts[0]


@pytest.mark.parametrize("impl", ["blockwise", "segment"])
def test_blockwise_model_keeps_samples_isolated(tiny_config, synthetic_batch, impl):
    model = Cosmos3(tiny_config, jnp.float32, attention=AttentionSpec(impl, 32))
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


def test_io_only_stand_in_also_serves_queries_over_other_keys(tiny_config, synthetic_batch):
    """Cosmos 3's generator queries read more keys than they are (S != L): the pricing stand-in
    keeps the output shapes there too."""
    batch = jax.tree.map(jnp.asarray, synthetic_batch)
    model = Cosmos3(tiny_config, jnp.float32, attention=AttentionSpec("io_only"))
    logits, pred = jax.eval_shape(lambda: model.apply(model.init(jax.random.key(0), batch), batch))
    assert logits.shape[:2] == batch["text_tokens_BT"].shape and pred.shape == batch["gen_x0_BVC"].shape

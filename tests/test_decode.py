"""KV-cached decoding (`xlaopt.inference.decode`) against the models' own training forward pass:
greedy tokens equal full recomputation token for token, sampling is seeded, bad input fails
with a UserError, and the decoding view of each tower matches the model's parameter tree."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.errors import UserError
from xlaopt.inference.decode import Decoding, layer_params, tower_of
from xlaopt.models.block import TransformerBlock
from xlaopt.models.cosmos3 import Cosmos3
from xlaopt.models.decoder import Decoder
from xlaopt.models.registry import get_config

B, PROMPT, NEW = 2, 8, 12
T = PROMPT + NEW
# Float32 logits of magnitude <= ~5 (ulp ~5e-7). KV decoding and the full forward pass do the same
# arithmetic in a different association (one query row against a masked cache vs. T rows, so XLA
# tiles and sums the matmuls differently): each dot of n <= 1024 fp32 terms is then off by a few
# ulps, a few 1e-6 after two layers and the LM head (<= 3e-6 measured on both towers). 1e-4
# leaves ~30x of that, while a real fault moves logits by O(1) (tried by hand: the decoded
# token's position off by one, or one unwritten cache slot unmasked: max differences above 5).
LOGITS_ATOL = 1e-4


def decoder_batch(tokens_BT, length: int) -> dict:
    """The first `length` tokens as one document; the rest padding, which they cannot see."""
    rows, cols = tokens_BT.shape
    index_BT = jnp.broadcast_to(jnp.arange(cols, dtype=jnp.int32), (rows, cols))
    return dict(tokens_BT=jnp.asarray(tokens_BT, jnp.int32), segment_ids_BT=(index_BT < length).astype(jnp.int32),
                positions_BT=index_BT)


def cosmos_batch(config, tokens_BT, length: int) -> dict:
    """Text only: one padding generator token, which reasoner queries never read anyway."""
    text = decoder_batch(tokens_BT, length)
    rows, V, C = tokens_BT.shape[0], 1, config.generator_in_dim
    zeros = lambda shape, dt=jnp.int32: jnp.zeros(shape, dt)
    return dict(text_tokens_BT=text["tokens_BT"], text_segment_ids_BT=text["segment_ids_BT"],
                text_positions_3BT=jnp.broadcast_to(text["positions_BT"], (3,) + tokens_BT.shape),
                gen_segment_ids_BV=zeros((rows, V)), gen_positions_3BV=zeros((3, rows, V), jnp.float32),
                gen_modality_BV=zeros((rows, V)), gen_action_domain_BV=zeros((rows, V)),
                gen_noisy_BV=zeros((rows, V), bool), gen_sigma_BV=zeros((rows, V), jnp.float32),
                gen_x0_BVC=zeros((rows, V, C), jnp.float32))


def build(name: str):
    """(model, params, text logits [B, T, E] of the training forward pass on (tokens, length))."""
    config = get_config(name, dict(num_layers=2))
    if name.startswith("llama"):
        model, batch_of = Decoder(config, jnp.float32), decoder_batch
        text_logits = lambda out: out
    else:
        model, batch_of = Cosmos3(config, jnp.float32), lambda t, n: cosmos_batch(config, t, n)
        text_logits = lambda out: out[0]
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batch_of(np.zeros((B, T), np.int32), T)))
    forward = jax.jit(lambda p, tokens_BT, n: text_logits(model.apply(p, batch_of(tokens_BT, n))))
    return model, params["params"], lambda tokens_BT, n: np.asarray(forward(params, tokens_BT, n))


def greedy_by_recomputation(forward, prompt_BP, new_tokens: int):
    """Greedy decoding that re-runs the whole model on the sequence so far at every step."""
    tokens_BT = np.zeros((B, T), np.int32)
    tokens_BT[:, :PROMPT] = prompt_BP
    logits = []
    for n in range(PROMPT, PROMPT + new_tokens):
        last_BE = forward(tokens_BT, n)[:, n - 1]
        tokens_BT[:, n] = last_BE.argmax(-1)
        logits.append(last_BE)
    return tokens_BT[:, PROMPT:], np.stack(logits, axis=1)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(7).integers(0, 4096, (B, PROMPT)).astype(np.int32)


@pytest.fixture(scope="module")
def run(prompt):
    """name -> (decoding, params, greedy KV generation, greedy recomputation), each built once."""
    runs = {}

    def get(name: str):
        if name not in runs:
            model, params, forward = build(name)
            decoding = Decoding(model)
            runs[name] = (decoding, params, decoding.generate(params, prompt, NEW, keep_logits=True),
                          greedy_by_recomputation(forward, prompt, NEW))
        return runs[name]
    return get


@pytest.mark.parametrize("name", ["llama-tiny", "cosmos3-tiny"])
def test_greedy_equals_full_recomputation(run, name):
    _, _, got, (want_tokens, want_logits) = run(name)
    np.testing.assert_array_equal(got.tokens_BN, want_tokens, err_msg=name)
    assert got.logits_BNE.shape == (B, NEW, 4096)
    np.testing.assert_allclose(got.logits_BNE, want_logits, rtol=0, atol=LOGITS_ATOL, err_msg=name)
    stats = got.stats
    assert stats["prefill_compile_s"] > 0 and stats["decode_compile_s"] > 0 and len(stats["decode_step_s"]) == NEW - 1


@pytest.mark.parametrize("name", ["llama-tiny", "cosmos3-tiny"])
def test_executables_are_reused(run, prompt, name):
    decoding, params, first, _ = run(name)
    again = decoding.generate(params, prompt, NEW)
    assert again.stats["prefill_compile_s"] == 0.0 and again.stats["decode_compile_s"] == 0.0
    np.testing.assert_array_equal(again.tokens_BN, first.tokens_BN)
    assert again.logits_BNE is None


def test_prefill_and_decode_step(run, prompt, monkeypatch):
    """The step functions by hand, in a cache larger than needed: unwritten slots stay masked; the
    layer stack is split from the caller's params once, not again for every token."""
    from xlaopt.inference import decode

    splits = []
    monkeypatch.setattr(decode, "layer_params", lambda tower, p: splits.append(1) or layer_params(tower, p))
    decoding, params, got, _ = run("llama-tiny")  # the step code is the same for both towers
    logits_BE, cache = decoding.prefill(params, prompt, T + 5)
    assert int(cache.length) == PROMPT and cache.max_len == T + 5
    for step in range(3):
        np.testing.assert_allclose(np.asarray(logits_BE), got.logits_BNE[:, step], rtol=0, atol=LOGITS_ATOL)
        logits_BE, cache = decoding.decode_step(params, got.tokens_BN[:, step], cache)
    assert int(cache.length) == PROMPT + 3
    assert len(splits) <= 1  # one prefill and three steps: four splits without the reuse


def test_seeded_sampling(run, prompt):
    decoding, params, _, _ = run("llama-tiny")
    draw = lambda seed: decoding.generate(params, prompt, NEW, temperature=1.0, key=jax.random.key(seed)).tokens_BN
    first = draw(1)
    np.testing.assert_array_equal(draw(1), first)
    assert (draw(2) != first).any()
    assert first.shape == (B, NEW) and first.min() >= 0 and first.max() < 4096


@pytest.mark.parametrize("kwargs, match", [
    (dict(new_tokens=0), "new_tokens=0"),
    (dict(new_tokens=NEW, cache_len=T - 1), f"exceed cache_len={T - 1}"),
    (dict(new_tokens=NEW, temperature=0.0, key=jax.random.key(0)), "temperature=0.0"),
    (dict(new_tokens=NEW, temperature=-1.0, key=jax.random.key(0)), "temperature=-1.0"),
    (dict(new_tokens=NEW, temperature=1.0), "needs a key"),
    (dict(new_tokens=NEW, key=jax.random.key(0)), "temperature is None"),
    (dict(new_tokens=NEW, prompt_BP=np.zeros((B, 0), np.int32)), "prompt_len >= 1"),
    (dict(new_tokens=NEW, prompt_BP=np.full((B, PROMPT), 4096, np.int32)), "vocabulary"),
])
def test_bad_input_is_a_user_error(run, prompt, kwargs, match):
    decoding, params, _, _ = run("llama-tiny")  # checked before anything compiles, whatever the model
    kwargs = dict(kwargs)
    with pytest.raises(UserError, match=match):
        decoding.generate(params, kwargs.pop("prompt_BP", prompt), kwargs.pop("new_tokens"), **kwargs)


@pytest.mark.parametrize("name, overrides", [
    ("llama-tiny", dict(tie_embeddings=True, qk_norm=True)),
    ("cosmos3-tiny", dict(reasoner_qk_norm=False, reasoner_key_norm_for_generator=True)),  # Edge
])
def test_tower_binds_the_models_own_parameters(name, overrides):
    """The block decoding builds has exactly the model's per-layer parameters (tracing only)."""
    config = get_config(name, dict(num_layers=2, **overrides))
    model = (Decoder if name.startswith("llama") else Cosmos3)(config, jnp.float32)
    batch = decoder_batch(np.zeros((1, 4), np.int32), 4) if name.startswith("llama") else \
        cosmos_batch(config, np.zeros((1, 4), np.int32), 4)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), batch))["params"]
    tower = tower_of(model)
    x = jnp.zeros((1, 4, config.d_model))
    rope = (jnp.zeros((1, 4, config.head_dim)),) * 2
    whole_block = lambda m, x, cos, sin: m.finish(x, m.qkv(x, cos, sin)[0])  # so every submodule makes its params
    init = functools.partial(TransformerBlock(**tower.block).init, method=whole_block)
    block = nn.meta.unbox(jax.eval_shape(init, jax.random.key(0), x, *rope))["params"]
    layer = jax.tree.map(lambda a: a.shape[1:], params["layers"][tower.layer_name])
    assert jax.tree.map(lambda a: a.shape, block) == layer
    assert tower.final_norm in params and ("lm_head_DE" not in params) == tower.tied_head

"""The generic decoder LLM: causality, document isolation, released sizes, FLOPs, sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.data.batch import BatchShape
from xlaopt.data.synthetic_text import SyntheticText
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.models.attention import AttentionSpec
from xlaopt.models.decoder import Decoder, forward_flops
from xlaopt.models.registry import get_config
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.runtime.verify import compare, one_step_grads
from xlaopt.step import param_count

from conftest import needs_devices


@pytest.fixture(scope="module")
def llama():
    config = get_config("llama-tiny", {"num_layers": 2})
    batch = SyntheticText(config, BatchShape(4, 64, 0), seed=1).batch(0)
    model = Decoder(config)
    params = jax.jit(model.init)(jax.random.key(0), jax.tree.map(jnp.asarray, batch))["params"]
    apply = jax.jit(lambda p, b: model.apply({"params": p}, b))
    return lambda b: np.asarray(apply(params, jax.tree.map(jnp.asarray, b))), batch


def test_later_tokens_never_reach_earlier_logits(llama):
    run, batch = llama
    logits = run(batch)
    later = {k: v.copy() for k, v in batch.items()}
    later["tokens_BT"][:, 40:] = (later["tokens_BT"][:, 40:] + 11) % 4096
    logits2 = run(later)
    np.testing.assert_array_equal(logits2[:, :40], logits[:, :40])
    assert np.abs(logits2[:, 40:] - logits[:, 40:]).max() > 1e-3


def test_documents_are_isolated(llama):
    run, batch = llama
    seg = batch["segment_ids_BT"][0]
    first = seg == 1
    assert (seg == 2).any()
    logits = run(batch)
    changed = {k: v.copy() for k, v in batch.items()}
    changed["tokens_BT"][0, first] = (changed["tokens_BT"][0, first] + 5) % 4096
    logits2 = run(changed)
    np.testing.assert_array_equal(logits2[0, ~first], logits[0, ~first])
    np.testing.assert_array_equal(logits2[1:], logits[1:])


@pytest.mark.parametrize("name, published", [("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9),
                                             ("llama3-405b", 405.85e9)])
def test_released_llama_sizes(name, published):
    assert abs(param_count(TrainProgram(get_config(name))) - published) / published < 0.01


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-405b"])
def test_llama3_rope_scaling_equals_transformers(name):
    """Llama 3.1's scaled rotary frequencies against transformers' own ("llama3" rope type)."""
    transformers = pytest.importorskip("transformers", reason="the parity extra")
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    c = get_config(name)
    reference = transformers.LlamaConfig(
        hidden_size=c.d_model, num_attention_heads=c.num_heads, head_dim=c.head_dim, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": c.rope_scaling_factor,
                         "low_freq_factor": c.rope_low_freq_factor, "high_freq_factor": c.rope_high_freq_factor,
                         "original_max_position_embeddings": c.rope_original_max_positions})
    want, _ = _compute_llama3_parameters(reference)
    got = np.asarray(c.rope_inv_freq())
    # Both from the same float64 formula; torch's pow on its float64 arange then rounds to fp32.
    np.testing.assert_allclose(got, want.float().numpy(), rtol=1e-6)
    slowest = c.rope_theta ** (-(c.head_dim - 2) / c.head_dim)
    assert got[0] == 1.0 and got[-1] == pytest.approx(slowest / 8, rel=1e-6)  # fastest pair kept, slowest 8x slower
    assert get_config("llama2-7b").rope_inv_freq() is None


def test_decoder_flops_by_hand():
    c = get_config("llama3-8b")
    n = 8192
    weights = 2 * 4096 * 32 * 128 + 2 * 4096 * 8 * 128 + 3 * 4096 * 14336
    expected = 2 * 32 * weights * n + 32 * 2 * 32 * 128 * n**2 + 2 * 4096 * 128256 * n
    assert forward_flops(c, n) == pytest.approx(expected)


def test_unknown_attention_is_refused_naming_the_choices():
    with pytest.raises(UserError, match=r"attention='flash'; use one of dense, blockwise, segment, cudnn, io_only"):
        ExecutionConfig(attention="flash")


def test_io_only_attention_keeps_the_parameters_and_changes_the_output():
    batch = jax.tree.map(jnp.asarray, SyntheticText(get_config("llama-tiny"), BatchShape(2, 16, 0), seed=0).batch(0))
    config = get_config("llama-tiny", {"num_layers": 1})
    models = {a: Decoder(config, attention=AttentionSpec(a)) for a in ("dense", "io_only")}
    shapes = {a: jax.eval_shape(m.init, jax.random.key(0), batch)["params"] for a, m in models.items()}
    assert shapes["io_only"] == shapes["dense"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.05, s.shape), s.dtype), shapes["dense"])
    logits = {a: jax.jit(m.apply)({"params": params}, batch) for a, m in models.items()}
    assert logits["io_only"].shape == logits["dense"].shape and not np.allclose(logits["io_only"], logits["dense"])


@needs_devices(8)
def test_decoder_sharded_matches_single_device():
    config = get_config("llama-tiny", {"num_layers": 2})
    settings = TrainSettings(batch=BatchShape(8, 64, 0))
    grads = []
    for mesh in ("", "data=2,fsdp=2,tensor=2"):
        program = TrainProgram(config, MeshSpec.parse(mesh), settings=settings,
                               execution=ExecutionConfig(compute_dtype="float32"))
        program, _ = run_pipeline(program, pipeline())
        grads.append(one_step_grads(program))
    result = compare(grads[1], grads[0], "float32")
    assert result["ok"], result


def test_the_heads_backward_runs_in_the_compute_dtype_and_differentiates_the_fp32_head():
    """`head_logits`: fp32 logits forward; the two backward matmuls in the compute dtype (autodiff
    of the fp32 output would run them in fp32, a third of llama3-8b's compiled GPU step); in
    float32 the gradients of plain autodiff."""
    from xlaopt.models.layers import head_logits

    keys = jax.random.split(jax.random.key(0), 3)
    h, w, g = (jax.random.normal(k, s) for k, s in zip(keys, ((2, 5, 8), (8, 16), (2, 5, 16))))
    plain = lambda h, w: jnp.einsum("btd,de->bte", h, w, preferred_element_type=jnp.float32)  # noqa: E731
    for ours, theirs in zip(jax.vjp(head_logits, h, w)[1](g), jax.vjp(plain, h, w)[1](g)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)  # the same sums, in another order
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    out, vjp = jax.vjp(head_logits, hb, wb)
    assert out.dtype == jnp.float32
    backward = jax.make_jaxpr(vjp)(g)
    dots = [e for e in backward.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    _, plain_vjp = jax.vjp(plain, hb, wb)
    plain_dots = [e for e in jax.make_jaxpr(plain_vjp)(g).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert any(v.aval.dtype == jnp.float32 for e in plain_dots for v in e.invars)  # what it replaces

"""Sharded inference (`xlaopt.inference.placement`) against one device: KV-cached greedy decoding
on tensor=2 and data=2,tensor=2 picks the same tokens (logits within float32 reassociation),
cached Cosmos 3 sampling with guidance on data=2,tensor=2 gives the same latents, and the work
really is split (parameters in the training layout, collectives in the compiled step, caches
sharded over rows and kv heads); plus `xlaopt generate --mesh` end to end and its refusals.

Every model, placement and executable is built once per module (2-layer tiny configs, float32)."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from xlaopt.cli import main
from xlaopt.execution import ExecutionConfig
from xlaopt.inference import sample_cosmos as sc
from xlaopt.inference.decode import Decoding
from xlaopt.inference.flow_schedule import FlowSchedule
from xlaopt.inference.placement import Placement
from xlaopt.mesh import MeshError, MeshSpec
from xlaopt.models.cosmos3 import Cosmos3
from xlaopt.models.decoder import Decoder
from xlaopt.models.registry import get_config

from conftest import needs_devices

pytestmark = needs_devices(4)

B, PROMPT, NEW = 2, 8, 6
TEXT, GEN, GUIDANCE, STEPS = 16, 32, 3.0, 5
MESHES = ["tensor=2", "data=2,tensor=2"]
# Float32 logits of magnitude <= ~4 (ulp ~5e-7). Tensor parallelism splits the contractions over
# heads (o_proj) and mlp (down projection) into per-device partial sums that an all-reduce adds,
# so each such dot is summed in another order: a few ulps per layer, <= 4e-6 measured on both
# meshes after two layers and the LM head. 1e-4 leaves 25x of that, while losing one shard's
# partial sum (half the heads' o_proj zeroed, tried by hand) moves the logits by 6.6.
LOGITS_ATOL = 1e-4
# A velocity differs by reassociation as the logits do (<= 1e-5, test_sample_cosmos's
# VELOCITY_ATOL), guidance multiplies that by up to 2g - 1 = 5, and 5 Euler steps integrate it
# over sigma 1 -> 0 (the steps' dt sum to 1): 5e-5, under 1e-4; measured <= 5e-6. Half the
# generator's heads lost from its o_proj (one tensor shard's partial sum) moves the sample by 2.2.
SAMPLE_ATOL = 1e-4


def placement(config, mesh: str) -> Placement:
    return Placement.on(config, MeshSpec.parse(mesh), ExecutionConfig(compute_dtype="float32"))


def init(model, batch: dict):
    return nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), {k: jnp.asarray(v) for k, v in batch.items()}))[
        "params"]


# ---- decoding ----


@pytest.fixture(scope="module")
def decoder():
    """(config, model, params, prompt [B, P], the one-device greedy generation with its logits)."""
    config = get_config("llama-tiny", dict(num_layers=2))
    model = Decoder(config, jnp.float32)
    zeros = np.zeros((B, PROMPT + NEW), np.int32)
    params = init(model, dict(tokens_BT=zeros, segment_ids_BT=zeros + 1, positions_BT=zeros))
    prompt_BP = np.random.default_rng(7).integers(0, config.vocab_size, (B, PROMPT)).astype(np.int32)
    return config, model, params, prompt_BP, Decoding(model).generate(params, prompt_BP, NEW, keep_logits=True)


@pytest.fixture(scope="module")
def sharded_decoding(decoder):
    """mesh -> (its Decoding, its greedy generation), each built once."""
    config, model, params, prompt_BP, _ = decoder
    runs = {}

    def get(mesh: str):
        if mesh not in runs:
            decoding = Decoding(model, placement(config, mesh))
            runs[mesh] = decoding, decoding.generate(params, prompt_BP, NEW, keep_logits=True)
        return runs[mesh]
    return get


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_greedy_decoding_equals_one_device(decoder, sharded_decoding, mesh):
    one = decoder[-1]
    _, got = sharded_decoding(mesh)
    np.testing.assert_array_equal(got.tokens_BN, one.tokens_BN, err_msg=mesh)
    assert float(np.abs(one.logits_BNE).max()) > 1.0  # real logits, not zeros on both sides
    np.testing.assert_allclose(got.logits_BNE, one.logits_BNE, rtol=0, atol=LOGITS_ATOL, err_msg=mesh)


@pytest.mark.parametrize("mesh, rows", [("tensor=2", None), ("data=2,tensor=2", "data")])
def test_decode_cache_is_sharded_and_donated(sharded_decoding, mesh, rows):
    """The one-token step's cache, a layer's keys [B, N, S, K] and values [B, N, K, S]: rows over the
    batch axes, kv heads over tensor, the same layout in as out (so the donated buffers are updated
    in place), and a collective in the step."""
    decoding, _ = sharded_decoding(mesh)
    (step,) = [exe for key, exe in decoding._compiled.items() if key[0] == "decode"]
    cache_in, cache_out = step.input_shardings[0][2], step.output_shardings[2]
    for k_in, k_out, v_in, v_out in zip(cache_in.k_BNSK, cache_out.k_BNSK, cache_in.v_BNKS, cache_out.v_BNKS):
        assert k_in.spec == k_out.spec == v_in.spec == v_out.spec == P(rows, "tensor")
    hlo = step.as_text()
    assert "input_output_alias" in hlo and "all-reduce" in hlo


def test_rows_that_do_not_divide_are_replicated(decoder, sharded_decoding):
    """One prompt on data=2: its row stays whole on both data halves, and decodes as on one device."""
    config, model, params, prompt_BP, one = decoder
    decoding, _ = sharded_decoding("data=2,tensor=2")
    assert decoding.placement.spec_of(("batch", "seq"), (1, PROMPT), "a prompt") == P()
    assert decoding.placement.spec_of(("batch", "seq"), (2, PROMPT), "a prompt") == P("data")
    got = decoding.generate(params, prompt_BP[:1], 3, keep_logits=True)
    np.testing.assert_array_equal(got.tokens_BN, one.tokens_BN[:1, :3])
    np.testing.assert_allclose(got.logits_BNE, one.logits_BNE[:1, :3], rtol=0, atol=LOGITS_ATOL)


# ---- Cosmos 3 sampling ----


@pytest.fixture(scope="module")
def cosmos():
    """(params, the sharded sampler, its sample, the one-device sample, the request), cached, guidance on."""
    config = get_config("cosmos3-tiny", dict(num_layers=2))
    model = Cosmos3(config, jnp.float32)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, config.vocab_size, TEXT), rng.integers(0, config.vocab_size, TEXT - 5)]
    request = sc.video_request(config, prompts, TEXT, sc.clip_grid(GEN), GUIDANCE)
    params = init(model, request.batch)
    x_T_BVC = request.noise(config, jax.random.key(2))
    schedule = FlowSchedule(STEPS, shift=3.0)
    one = sc.CosmosSampler(model).sample(params, request, x_T_BVC, schedule, order=1, cached=True)
    sampler = sc.CosmosSampler(model, placement(config, "data=2,tensor=2"))
    return params, sampler, sampler.sample(params, request, x_T_BVC, schedule, order=1, cached=True), one, request


def test_sharded_cached_sampling_equals_one_device(cosmos):
    _, _, got, one, _ = cosmos
    assert got.stats["model_calls"] == one.stats["model_calls"] == STEPS and got.stats["cfg"]
    assert float(np.abs(one.x0_BVC).max()) > 0.5
    np.testing.assert_allclose(got.x0_BVC, one.x0_BVC, rtol=0, atol=SAMPLE_ATOL)


def test_sampling_work_is_split(cosmos):
    params, sampler, _, _, _ = cosmos
    placed = sampler.placement.put_params(params)
    for tower in ("reasoner", "generator"):
        assert "tensor" in placed["layers"][tower]["q_proj_DHK"].sharding.spec, tower  # heads split, as in training
    step = sampler._compiled[next(k for k in sampler._compiled if k[0] == ("cached", True))]
    assert "all-reduce" in step.as_text()  # the partial sums of the tensor-split projections
    prefill = sampler._compiled[next(k for k in sampler._compiled if k[0] == "prefill")]
    kv = prefill.output_shardings
    assert kv.k_LBTNK.spec == kv.v_LBTNK.spec == P(None, "data", None, "tensor")  # both branches' rows, kv heads


def test_guidance_branches_run_on_separate_device_groups(cosmos):
    """CFG parallel: a guided request's rows are its prompts' conditional rows, then their
    unconditional ones, so over data=2 each data group prefills and denoises one branch (its own
    K/V; the velocities meet only in the guided combination), and the sample above equals one
    device's. `plan --serve video` prices this layout as cfg2."""
    params, sampler, _, _, request = cosmos
    cache, _ = sampler.prefill(params, request)
    mesh = sampler.placement.mesh
    coord = {d: idx for idx, d in np.ndenumerate(mesh.devices)}
    data_axis = mesh.axis_names.index("data")
    for shard in cache.k_LBTNK.addressable_shards:
        rows = range(*shard.index[1].indices(2 * B))
        branch = {"cond" if r < B else "uncond" for r in rows}
        assert branch == ({"cond"} if coord[shard.device][data_axis] == 0 else {"uncond"}), (shard.device, rows)


def test_ulysses_sampling_with_cfg_parallel_equals_one_device(cosmos):
    """data=2 x context=2: the guidance branches on two device groups, each row's positions split
    over the context ranks, every attention (the reasoner's prefill and the generator's queries
    over the cached text keys and its own) through Ulysses' all-to-alls on whole rows with half the
    heads; the sample equals one device's within the same bound as tensor parallelism's."""
    params, _, _, one, request = cosmos
    config = get_config("cosmos3-tiny", dict(num_layers=2))
    sampler = sc.CosmosSampler(Cosmos3(config, jnp.float32),
                               Placement.on(config, MeshSpec.parse("data=2,context=2"),
                                            ExecutionConfig(compute_dtype="float32"), positions=True))
    got = sampler.sample(params, request, request.noise(config, jax.random.key(2)), FlowSchedule(STEPS, shift=3.0),
                         order=1, cached=True)
    np.testing.assert_allclose(got.x0_BVC, one.x0_BVC, rtol=0, atol=SAMPLE_ATOL)
    for name in ("prefill", ("cached", True)):
        hlo = sampler._compiled[next(k for k in sampler._compiled if k[0] == name)].as_text()
        assert "all-to-all" in hlo, name
    with pytest.raises(MeshError, match="decoding does not"):
        Placement.on(config, MeshSpec.parse("context=2"), ExecutionConfig(compute_dtype="float32"))


# ---- the command line ----

TINY = ["--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128", "--set", "num_heads=4",
        "--set", "num_kv_heads=2"]
TENSOR2 = {"stage": 1, "data": 1, "fsdp": 1, "tensor": 2, "context": 1}


@pytest.mark.parametrize("args", [
    ["--model", "llama-tiny", "--set", "num_layers=1", "--prompt-len", "6", "--new-tokens", "4"],
    ["--model", "cosmos3-tiny", *TINY, "--batch-size", "2", "--prompt-len", "8", "--gen-len", "16", "--steps", "3"],
], ids=["text", "video"])
def test_cli_generate_on_a_mesh(tmp_path, capsys, args):
    out = tmp_path / "gen.json"
    assert main(["generate", *args, "--mesh", "tensor=2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["mesh"] == TENSOR2
    assert "on tensor=2" in capsys.readouterr().out
    if r["mode"] == "video":
        assert r["max_abs_diff_vs_uncached"] <= SAMPLE_ATOL  # cached equals uncached on the mesh too
    else:
        assert len(r["tokens"][0]) == 4


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-tiny", "--mesh", "tensor=3"], "tensor=3 does not divide"),
    (["--model", "cosmos3-tiny", *TINY, "--mesh", "tensor=4"], "kv_heads, size 2"),
    (["--model", "llama-tiny", "--mesh", "context=2"], "split positions"),
])
def test_cli_refuses_a_mesh_that_does_not_fit_in_one_line(capsys, args, message):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err

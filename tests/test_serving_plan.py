"""The serving planner: inference layouts with no gradients or optimizer state, the KV cache in
the memory model, tensor parallelism where a token step's latency wants it."""
import json

import pytest

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.topology import parse_topology
from xlaopt.cli import main
from xlaopt.errors import UserError
from xlaopt.layout import load_layout
from xlaopt.models.registry import get_config
from xlaopt.planning.serving import Request, plan_serving, price_decode

NODE = parse_topology("h100:1x8")


def test_llama3_70b_decode_on_one_node_is_tensor_parallel_over_all_eight():
    """141 GB of bf16 weights do not fit one H100; a token step reads every weight once, so the
    latency falls with each device that shares the reading: tp=8 first, and so on down."""
    ranked = plan_serving(get_config("llama3-70b"), NODE, Request("decode", 8, context=8192))
    fits = [(p.dp, p.tp) for p in ranked if not p.reason]
    assert fits == [(1, 8), (2, 4), (4, 2)]
    assert [p for p in ranked if p.tp == 1][0].reason.startswith("needs 133.9 GiB per device")
    best = ranked[0]
    # Memory-bound: the layers' time is their weights and cache read at HBM bandwidth.
    c = get_config("llama3-70b")
    read = best.memory_parts["weights"] - 2 * 2 * c.d_model * c.vocab_size / 8 + best.memory_parts["kv_cache"]
    assert best.parts["layers"] == pytest.approx(read / NODE.device.hbm_bytes_per_s, rel=1e-6)
    assert best.parts["tp_collectives"] > 0


def test_the_kv_cache_is_in_the_memory_model():
    c, eff = get_config("llama3-8b"), cm.efficiency_for(NODE)
    short, long = (price_decode(c, Request("decode", 16, context=n), 1, 8, NODE, eff) for n in (1024, 8192))
    # 16 rows x n tokens x 2 (k, v) x 1 kv head a rank (8 over tp=8) x 128 x 2 bytes x 32 layers
    assert long.memory_parts["kv_cache"] - short.memory_parts["kv_cache"] == 16 * 7168 * 2 * 1 * 128 * 2 * 32
    assert long.step_s > short.step_s


def test_cosmos3_denoising_prices_the_cached_and_the_uncached_step():
    ranked = plan_serving(get_config("cosmos3-nano"), NODE, Request("denoise", 2, text=512, gen=7680))
    best = next(p for p in ranked if not p.reason)
    assert best.uncached_step_s > best.step_s > 0  # the reasoner's tokens are not recomputed


@pytest.mark.parametrize("model, mode, message", [
    ("llama-tiny", "denoise", "has no generator"),
    ("resnet-tiny", "decode", "has none"),
])
def test_serving_what_a_model_cannot_do_is_refused(model, mode, message):
    with pytest.raises(UserError, match=message):
        plan_serving(get_config(model), NODE, Request(mode, 1, context=16, text=8, gen=8))


def test_cli_plan_serve_writes_a_tensor_parallel_layout(tmp_path, capsys):
    out, layout = tmp_path / "serve.json", tmp_path / "serve.toml"
    assert main(["plan", "--model", "llama3-70b", "--topology", "h100:1x8", "--serve", "decode",
                 "--json", str(out), "--out", str(layout)]) == 0
    assert load_layout(layout).mesh.as_dict()["tensor"] == 8
    result = json.loads(out.read_text())
    assert result["candidates"][0]["tp"] == 8 and "kv_cache" in result["candidates"][0]["memory_parts"]
    assert main(["plan", "--model", "llama3-70b", "--topology", "h100:1x8", "--serve", "decode",
                 "--global-batch", "512", "--context", "131072"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no serving layout of llama3-70b fits" in err[0]


@pytest.mark.parametrize("mesh", ["tensor=2"])
def test_analyze_a_compiled_decode_step_on_a_mesh(mesh, tmp_path):
    """The decode step `generate` runs, compiled from abstract sharded arrays: its arguments are
    the weights and cache the analytic model counts, the cache is updated in place (donated and
    aliased), and tensor parallelism all-reduces."""
    out = tmp_path / "decode.json"
    assert main(["analyze", "--model", "llama-tiny", "--set", "num_layers=2", "--mesh", mesh, "--topology", "h100:1x8",
                 "--serve", "decode", "--context", "256", "--target", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c = get_config("llama-tiny")
    cache = 2 * 2 * 8 * 256 * (c.num_kv_heads // 2) * c.head_dim * 2  # k and v, 2 layers, 8 rows, bf16, per device
    assert r["memory"]["aliased"] == cache + 4  # and the cache length, an int32
    assert 0.95 < r["memory"]["arguments"] / r["analytic_memory_bytes"] <= 1.0  # the analytic adds activations
    assert r["all_reduces"] >= 1 and r["step_time_s"] > 0
    # The floor: every argument (weights, cache) read once over the device's HBM bandwidth.
    assert r["floor_s"] == pytest.approx(r["memory"]["arguments"] / 3.35e12) and r["step_over_floor"] >= 1.0


def test_analyze_a_compiled_denoising_step_cached_and_uncached(tmp_path):
    """Cosmos 3's denoising step compiled both ways on tensor=2: the cached one takes the generator's
    weights and the reasoner's K/V, not the reasoner's weights, and does less work."""
    out = tmp_path / "denoise.json"
    assert main(["analyze", "--model", "cosmos3-tiny", "--set", "num_layers=1", "--mesh", "tensor=2", "--topology",
                 "h100:1x8", "--serve", "denoise", "--text-tokens", "64", "--gen-tokens", "64", "--target", "cpu",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cached"]["memory"]["arguments"] < r["uncached"]["memory"]["arguments"]
    assert r["uncached"]["step_time_s"] > r["cached"]["step_time_s"] > 0 and r["speedup_vs_uncached"] > 1
    assert r["analytic"]["uncached_step_s"] > r["analytic"]["cached_step_s"]
    assert r["cached"]["all_reduces"] >= 1


def test_a_gpu_decode_step_reads_weights_and_cache_in_place(monkeypatch):
    """On XLA's deviceless H100 compile (jax 0.10.2) the decode step has no copy of a layer's
    weights out of a stack (no dynamic-slice) and no transpose of a cache, and every cache buffer
    is updated in place: what the serving layout (`decode.layer_params`, values [B, N, K, S]) is
    for. Before it, this program held one dynamic-slice fusion per weight per layer and transposed
    the whole value cache in and out (BENCHMARKS.md, issue 30)."""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    from xlaopt.mesh import MeshSpec
    from xlaopt.planning import serving_step
    from xlaopt.sharding import DEFAULT_RULES

    texts = []
    priced = serving_step._priced
    monkeypatch.setattr(serving_step, "_priced", lambda compiled, *a: texts.append(compiled.as_text())
                        or priced(compiled, *a))
    config = get_config("llama-tiny", {"num_layers": 2})
    r = serving_step.analyze_decode(config, MeshSpec.parse("tensor=2"), DEFAULT_RULES, parse_topology("h100:1x8"),
                                    "gpu", 8, 256)
    (hlo,) = texts
    assert "dynamic-slice(" not in hlo and "dynamic_slice_fusion" not in hlo
    assert "transpose" not in hlo.split("ENTRY")[1]  # the entry computation: the per-step ops
    # Both layers' keys and values, and the cache length: aliased to the outputs.
    assert hlo.count("may-alias") + hlo.count("must-alias") >= 4
    assert r["cache_aliased"] and r["step_over_floor"] >= 1.0
    # Every tensor-parallel all-reduce (8 rows of d_model in bf16) is annotated for XLA's one-shot
    # kernel, which the option runs. Over two GPUs it takes NCCL's two latency steps, so the prices
    # agree; the saving is over more (tests/test_all_reduce_kernels.py).
    assert r["kernel_all_reduces"] == r["all_reduces"] >= 4
    assert r["step_time_s"] == pytest.approx(r["step_time_nccl_s"], rel=0.01)

"""attention=cudnn: JAX's fused cuDNN attention over packed rows, on the gpu target only.

Its numbers cannot be checked without a GPU. Checked here on the CPU: the jax-0.10.2 functions it
patches exist and the key-offset fix's arithmetic; the refusals (cpu target, too many samples a
row); the segment starts, lengths and key order against a hand-built row, and that attention
restricted to those segments equals dense attention (everything but the cuDNN kernel itself);
and, with the gpu-aot extra, that the step compiles deviceless to the fused kernels and that the
analysis prices them with the FLOPs of the batch."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.compile import CompiledProgram, compile_program
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.families import family_of
from xlaopt.mesh import MeshSpec, make_mesh
from xlaopt.models import cudnn_jax_patches
from xlaopt.models.attention import attention, dense_attention
from xlaopt.models.cudnn_attention import (
    BACKWARD_OVER_FORWARD,
    BACKWARD_TARGET,
    FORWARD_TARGET,
    causal_segments,
    check_rows,
    fused_tag,
    generator_segments,
    pairs_computed,
)
from xlaopt.models.masks import Tokens
from xlaopt.program import TrainProgram, TrainSettings

from conftest import needs_devices

CUDNN = ExecutionConfig(attention="cudnn", attention_max_segments=8)


def test_the_patched_jax_functions_exist_and_the_kv_offsets_follow_the_key_heads():
    """An upgrade that renames or fixes them fails here: revisit xlaopt/models/cudnn_jax_patches.py."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    assert jax.__version__ == cudnn_jax_patches.JAX_VERSION
    assert all(callable(getattr(fa, name, None)) for name in cudnn_jax_patches.PATCHED)
    original = getattr(fa._fix_seqlen_offsets, "__wrapped__", fa._fix_seqlen_offsets)  # install() may have run
    H, N, K = 8, 2, 16
    q, k = jnp.zeros((1, 16, H, K), jnp.bfloat16), jnp.zeros((1, 16, N, K), jnp.bfloat16)
    seqlen, offsets = jnp.array([[8, 8, -1]], jnp.int32), jnp.array([[0, 8, -1, -1]], jnp.int32)
    assert original(seqlen, seqlen, offsets, offsets, q, k)[3].tolist()[0][:2] == [0, 8 * H * K]  # the bug
    fixed = cudnn_jax_patches._kv_offsets_per_key_head(original)(seqlen, seqlen, offsets, offsets, q, k)
    assert fixed[3].tolist()[0][:2] == [0, 8 * N * K] and fixed[2].tolist()[0][:2] == [0, 8 * H * K]


def test_the_cpu_target_is_refused(tiny_config):
    with pytest.raises(UserError, match=r"attention=cudnn .* NVIDIA GPUs only; the cpu target needs attention=segment"):
        TrainProgram(tiny_config, execution=CUDNN)


def test_a_split_sequence_runs_only_through_ulysses(tiny_config):
    """Found on jax 0.10.2: its cuDNN attention partitioner raises "Sharding on sequence dim is not
    allowed" deep in the compile. A context split reaches cuDNN only through Ulysses: where the
    query heads cannot split over context the program says so up front, and a program
    without the Ulysses transform is refused before it compiles."""
    with pytest.raises(UserError, match=r"attention=cudnn cannot split a row's sequence .* needs the 2 query heads "
                                        r"of each tensor rank to split over context=4; use a context size of 1, 2,"):
        TrainProgram(tiny_config, MeshSpec.parse("context=4,tensor=4"), execution=CUDNN, target="gpu")
    program = TrainProgram(tiny_config, MeshSpec.parse("context=2,fsdp=2"), execution=CUDNN, target="gpu")
    with pytest.raises(UserError, match=r"runs only through Ulysses attention; compile the program after the "
                                        r"ulysses-attention pass"):
        compile_program(program)
    TrainProgram(tiny_config, MeshSpec.parse("fsdp=4"), execution=CUDNN, target="gpu")  # batch-split is fine


def test_rows_over_the_segment_budget_are_refused_before_the_step(tiny_config):
    program = TrainProgram(tiny_config, settings=TrainSettings(batch=BatchShape(2, 16, 16)), execution=CUDNN,
                           target="gpu")
    batch = {"text_segment_ids_BT": np.zeros((2, 16), np.int32), "gen_segment_ids_BV": np.zeros((2, 16), np.int32)}
    batch["text_segment_ids_BT"][1] = np.repeat(np.arange(1, 9), 2)  # 8 samples: fits
    check_rows(batch, 8)
    batch["gen_segment_ids_BV"][1, :9] = np.arange(1, 10)  # 9 samples in row 1
    with pytest.raises(UserError, match=r"row 1 of the batch holds 9 samples \(gen_segment_ids_BV\) but "
                                        r"attention_max_segments=8; raise it \(--exec attention_max_segments=9\)"):
        CompiledProgram(program).put_batch(batch)  # refused on the host, before any transfer
    with pytest.raises(UserError, match=r"row 0 of text_segment_ids_BT has its samples out of order"):
        check_rows({"text_segment_ids_BT": np.array([[1, 1, 0, 2]])}, 8)


def _row():
    """Text [1 1 1 | 2 2 | 3 | pad pad], generator [1 1 | 2 2 2 | pad pad pad]: sample 3 has no
    generator tokens."""
    text, gen = np.array([[1, 1, 1, 2, 2, 3, 0, 0]]), np.array([[1, 1, 2, 2, 2, 0, 0, 0]])
    keys = Tokens.of(jnp.asarray(np.concatenate([text, gen], 1)), jnp.asarray(np.arange(16) >= 8)[None])
    return Tokens.of(jnp.asarray(text), jnp.zeros((1, 8), bool)), keys.slice(8, 16), keys


def test_segments_and_key_order_of_a_hand_built_row():
    text, gen, keys = _row()
    s = causal_segments(text, max_segments=4)  # slots: samples 1..4, then padding
    assert s.q_seqlen_BM.tolist() == s.kv_seqlen_BM.tolist() == [[3, 2, 1, -1, 2]]
    assert s.q_offsets_BM1.tolist() == s.kv_offsets_BM1.tolist() == [[0, 3, 5, -1, 6, -1]]
    g, order = generator_segments(gen, keys, max_segments=4)
    assert g.q_seqlen_BM.tolist() == [[2, 3, -1, -1, 3]] and g.q_offsets_BM1.tolist() == [[0, 2, -1, -1, 5, -1]]
    assert g.kv_seqlen_BM.tolist() == [[5, 5, -1, -1, 5]] and g.kv_offsets_BM1.tolist() == [[0, 5, -1, -1, 11, -1]]
    # Each sample's keys [text_i | gen_i] (keys 0-7 text, 8-15 generator); sample 3's text lies
    # between, in no segment; padding last.
    assert order.tolist() == [[0, 1, 2, 8, 9, 3, 4, 10, 11, 12, 5, 6, 7, 13, 14, 15]]
    assert pairs_computed(text, text).tolist() == [6 + 3 + 1 + 3]
    assert pairs_computed(gen, keys).tolist() == [2 * 5 + 3 * 5 + 3 * 5]


def _segment_mask(s, L: int, S: int, causal: bool) -> jax.Array:
    """[B, L, S] the pairs cuDNN's packed layout computes: within each used segment, causal from
    the segment's start or full."""
    l, k = jnp.arange(L)[None, :, None, None], jnp.arange(S)[None, None, :, None]
    q0, qn = s.q_offsets_BM1[:, None, None, :-1], s.q_seqlen_BM[:, None, None, :]
    k0, kn = s.kv_offsets_BM1[:, None, None, :-1], s.kv_seqlen_BM[:, None, None, :]
    inside = (qn > 0) & (q0 <= l) & (l < q0 + qn) & (k0 <= k) & (k < k0 + kn)
    return jnp.any(inside & (~causal | (k - k0 <= l - q0)), axis=-1)


def _calls_with_inputs(config, batch, seed: int):
    """Each attention call of `batch` with random q [B, L, H, K] and k, v [B, S, N, K] (float32)."""
    H, N, K = config.num_heads, config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(seed)
    for q_tok, k_tok in family_of(config).attention_calls(batch):
        (B, L), S = q_tok.segment_BL.shape, k_tok.segment_BL.shape[1]
        q = jnp.asarray(rng.standard_normal((B, L, H, K)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((B, S, N, K)), jnp.float32) for _ in range(2))
        yield q_tok, k_tok, q, k, v


def test_attention_over_the_segments_equals_dense(tiny_config, synthetic_batch):
    """The reference path minus the kernel: the segments and key order fed to masked attention
    give dense attention's outputs at every position, padding included."""
    for q_tok, k_tok, q, k, v in _calls_with_inputs(tiny_config, synthetic_batch, seed=0):
        (B, L), S = q_tok.segment_BL.shape, k_tok.segment_BL.shape[1]
        if L == S:
            segments, order = causal_segments(q_tok, 8), jnp.broadcast_to(jnp.arange(S), (B, S))
        else:
            segments, order = generator_segments(q_tok, k_tok, 8)
        take = lambda x, order=order: jnp.take_along_axis(x, order[:, :, None, None], axis=1)
        packed = attention(q, take(k), take(v), _segment_mask(segments, L, S, causal=L == S))
        np.testing.assert_allclose(packed, dense_attention(q, k, v, q_tok, k_tok), rtol=1e-5, atol=1e-5)


# --- deviceless GPU compile (the gpu-aot extra) --------------------------------------------------

@pytest.fixture(scope="module")
def gpu_analysis(tiny_config, tmp_path_factory):
    pytest.importorskip("jax_cuda12_plugin", reason="the deviceless GPU compile needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis.analyze import analyze
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.pipeline import pipeline, run_pipeline, select_passes

    program = TrainProgram(tiny_config, MeshSpec.parse("fsdp=2"), settings=TrainSettings(batch=BatchShape(2, 48, 96)),
                           execution=CUDNN, target="gpu")
    # Without overlap-flags: its loop double buffering unrolls the layer loop by two, and the
    # kernels are counted here per attention call of one layer body.
    program = run_pipeline(program, select_passes(pipeline(), disable=["overlap-flags"]))[0]
    dump = tmp_path_factory.mktemp("cudnn")
    result = analyze(program, parse_topology("h100:1x8"), "gpu", dump_dir=str(dump))
    return program, result, (dump / "analyzed-gpu.compiled.hlo").read_text()


def test_the_step_compiles_deviceless_to_the_fused_kernels(gpu_analysis):
    _, _, text = gpu_analysis
    for target in (FORWARD_TARGET, BACKWARD_TARGET):  # one per attention call of the layer
        assert text.count(f'custom_call_target="{target}"') == 2
    for tag in (fused_tag(48, 48), fused_tag(96, 144)):
        assert tag in text
    # Reasoner causal within its segments, the generator full within them; 8 samples + padding.
    forward = [line for line in text.splitlines() if f'custom_call_target="{FORWARD_TARGET}"' in line]
    masks = {"48,32]" in line.split("custom-call(")[0]: line.split('mask_type": "')[1].split('"')[0] for line in forward}
    assert masks == {True: "PADDING_CAUSAL", False: "PADDING"}
    assert all('max_seg_per_batch": 9,' in line for line in forward)
    # No dense logits: nothing of [.., 48, 48] (reasoner) or [.., 96, 144] (generator) is built.
    assert not any(f",{a},{b}]" in text or f"[{a},{b}]" in text for a, b in ((48, 48), (96, 144)))


def test_the_analysis_prices_the_fused_calls_with_the_batchs_flops(gpu_analysis, tiny_config):
    from xlaopt.analysis import costmodel
    from xlaopt.analysis.attention_work import batch_work, needed_pairs
    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.schedule import build_schedule
    from xlaopt.analysis.simulate import compute_time_s
    from xlaopt.analysis.topology import parse_topology

    program, result, text = gpu_analysis
    arrays = synthetic_batch(program).arrays
    work = batch_work(program, arrays)
    c = tiny_config
    calls = family_of(c).attention_calls(arrays)
    expected = {}
    for q, k in calls:  # fsdp=2: one row a device, the busier row priced
        forward = 4.0 * c.num_heads * c.head_dim * float(pairs_computed(q, k).max())
        expected[fused_tag(q.segment_BL.shape[1], k.segment_BL.shape[1])] = {
            FORWARD_TARGET: forward, BACKWARD_TARGET: BACKWARD_OVER_FORWARD * forward}
    assert work.custom_call_flops == expected  # integers times 4 H K and 2.5: exact
    assert work.pairs_executed == sum(pairs_computed(q, k).sum() for q, k in calls)
    assert work.pairs_executed >= sum(needed_pairs(q, k).sum() for q, k in calls)  # padding's segment too

    unpriced, priced = build_schedule(text, work.loop_trips), build_schedule(text, work.loop_trips, expected)
    per_layer = sum(f for by_target in expected.values() for f in by_target.values())
    assert priced.flops - unpriced.flops == pytest.approx(c.num_layers * per_layer, rel=1e-9)
    # The step is priced on the busier device; the FLOPs the cluster executes are each device's own.
    mean = {tag: {target: f * float(pairs_computed(q, k).mean()) / float(pairs_computed(q, k).max())
                  for target, f in by_target.items()}
            for (tag, by_target), (q, k) in zip(expected.items(), calls)}
    assert work.mean_custom_call_flops.keys() == mean.keys()
    assert all(work.mean_custom_call_flops[tag] == pytest.approx(mean[tag]) for tag in mean)
    assert result["hlo_matmul_flops_per_step"] == pytest.approx(2 * build_schedule(text, {}, mean).flops, rel=1e-9)
    fused = [op for op in priced.ops if op.fused_attention]
    assert len(fused) == 4 * c.num_layers
    h100 = parse_topology("h100:1x8")
    op = max(fused, key=lambda o: o.flops)
    at_attention_efficiency = costmodel.attention_time_s(op.flops, h100.device.peak_flops["bfloat16"],
                                                         costmodel.FITTED)
    assert compute_time_s(op, h100) == pytest.approx(max(at_attention_efficiency,
                                                         op.bytes / h100.device.hbm_bytes_per_s))
    # Compute-bound (this tiny model's kernels are bound by their bytes either way), the flag is
    # what prices it: at fused attention's efficiency, not as bytes.
    big = dataclasses.replace(op, flops=1e15)
    assert compute_time_s(big, h100) == pytest.approx(costmodel.attention_time_s(
        1e15, h100.device.peak_flops["bfloat16"], costmodel.FITTED))
    assert compute_time_s(dataclasses.replace(big, fused_attention=False), h100) == pytest.approx(
        big.bytes / h100.device.hbm_bytes_per_s)


def test_without_the_cuda_plugin_the_fix_is_named(monkeypatch):
    """Found in CI (no gpu-aot extra): jaxlib then has no cuda_versions, and cuDNN's own check fails
    with an AttributeError deep in tracing; the patches say what to install instead."""
    from jax._src import lib

    monkeypatch.setattr(lib, "cuda_versions", None)
    with pytest.raises(UserError, match=r"needs JAX's CUDA plugin.*gpu-aot.*attention=segment"):
        cudnn_jax_patches.install()


def test_flops_are_per_device_heads_under_tensor_parallelism(tiny_config):
    """The deviceless compile of this layout runs each call on H / 2 heads a device (bf16[1,4,48,32]
    for the tiny model's 8 heads): the FLOPs given follow the heads the layout splits, and under
    Ulysses the heads each call runs (undivided, nano's 720p step priced 4.29x the model's FLOPs
    on fsdp=4,context=2 against 1.42x on fsdp=8)."""
    pytest.importorskip("jax_cuda12_plugin", reason="tracing cuDNN attention needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis.attention_work import _heads_per_call, _heads_per_device
    from xlaopt.pipeline import pipeline, run_pipeline

    program = TrainProgram(tiny_config, MeshSpec.parse("fsdp=2,tensor=2"),
                           settings=TrainSettings(batch=BatchShape(2, 48, 96)), execution=CUDNN, target="gpu")
    assert _heads_per_device(program) == tiny_config.num_heads  # no layout yet: nothing split
    assert _heads_per_device(run_pipeline(program, pipeline())[0]) == tiny_config.num_heads // 2
    # Under Ulysses each call runs on its context rank's share of the heads, in 2 head groups.
    ulysses = TrainProgram(tiny_config, MeshSpec.parse("fsdp=2,context=2"), settings=program.settings,
                           execution=CUDNN, target="gpu")
    laid = run_pipeline(ulysses, pipeline())[0]
    assert [t.name for t in laid.grad_transforms] == ["ulysses-attention"]
    assert _heads_per_call(laid) == tiny_config.num_heads // (2 * 2)


@needs_devices(8)
def test_inside_a_partly_manual_shard_map_the_call_runs_manual_over_every_axis(tiny_config, synthetic_batch,
                                                                             monkeypatch):
    """In a shard_map manual over `stage` (a pipeline's stages), the cuDNN call runs per device
    over the other axes too, rows and heads where the layout splits them: with the kernel
    replaced by attention over the same segments, every call's output equals the one-device
    call's, so the specs hand each device whole rows, its heads and its rows' segments."""
    from jax.sharding import PartitionSpec

    from xlaopt.models import cudnn_attention as lib
    from xlaopt.models.layers import heads_split_over, rows_split_over

    def kernel(q, k, v, segments, causal):
        return attention(q, k, v, _segment_mask(segments, q.shape[1], k.shape[1], causal))

    monkeypatch.setattr(lib, "_fused", kernel)
    mesh = make_mesh(MeshSpec.parse("stage=2,data=2,tensor=2"))
    for q_tok, k_tok, q, k, v in _calls_with_inputs(tiny_config, synthetic_batch, seed=1):
        whole = lib.cudnn_attention(q, k, v, q_tok, k_tok, max_segments=8)
        staged = jax.shard_map(lambda *a: lib.cudnn_attention(*a, max_segments=8), mesh=mesh,
                               in_specs=PartitionSpec(), out_specs=PartitionSpec(), axis_names={"stage"},
                               check_vma=False)
        with jax.set_mesh(mesh), rows_split_over(("data",)), heads_split_over(("tensor",)):
            text = jax.jit(staged).lower(q, k, v, q_tok, k_tok).as_text()
            out = jax.jit(staged)(q, k, v, q_tok, k_tok)
        assert text.count("sdy.manual_computation") == 2  # stage, then every other axis
        np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-5)


def test_a_micro_batch_of_one_row_compiles_on_an_automatic_mesh():
    """One sequence a micro-batch (Megatron's micro-batch 1) under tensor parallelism: JAX's own
    partitioning rule for the call fails Shardy's verifier on a row dimension of 1 on jax 0.10.2,
    so such a call runs in a shard_map manual over every axis, its heads split as the layout
    splits them; the step compiles deviceless to the fused kernels."""
    pytest.importorskip("jax_cuda12_plugin", reason="the deviceless GPU compile needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis import gpu_aot
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.mesh import MESH_AXES
    from xlaopt.pipeline import pipeline, run_pipeline

    from conftest import LLAMA_TINY

    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("tensor=2"), settings=TrainSettings(batch=BatchShape(2, 48, 0)),
                           execution=dataclasses.replace(CUDNN, micro_batches=2), target="gpu")
    program = run_pipeline(program, pipeline())[0]
    devices = gpu_aot.gpu_mesh(parse_topology("h100:1x2"), program.mesh.sizes, MESH_AXES)
    text = compile_program(program, devices).train_step.as_text()
    forward = [line for line in text.splitlines() if f'custom_call_target="{FORWARD_TARGET}"' in line]
    heads = LLAMA_TINY.num_heads // 2
    # One row, this rank's heads: bf16[1, H / 2, 48, K] out of each forward call.
    assert forward and all(f"bf16[1,{heads},48,{LLAMA_TINY.head_dim}]" in line.split("custom-call(")[0]
                           for line in forward), forward[:1]

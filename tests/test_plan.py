"""The layout planner: the space it searches, the analytic shape it prices, the ranking it
returns (compiled on this machine's simulated devices), the layout file it writes (trained and
verified for real), re-planning onto fewer devices, and its bad-input messages."""
import json

import numpy as np
import pytest

from xlaopt.cli import main
from xlaopt.data.batch import BatchShape
from xlaopt.execution import ExecutionConfig
from xlaopt.layout import load_layout
from xlaopt.models.registry import get_config
from xlaopt.planning.space import enumerate_space

from conftest import needs_devices

LLAMA = ["--model", "llama-tiny", "--set", "num_layers=2"]


def test_space_holds_dp_fsdp_hsdp_and_says_why_the_rest_cannot_be_built():
    config = get_config("llama-tiny")  # 8 heads, 4 kv heads
    ok, rejected = enumerate_space(config, BatchShape(16, 32, 0), 16, 8, "dense", ("bfloat16",))
    kinds = {c.kind for c in ok}
    assert {"DP", "FSDP", "HSDP", "FSDP+TP2", "HSDP+TP4", "DP+TP4+CP2"} <= kinds
    assert all(c.num_devices == 16 and c.tp * c.cp <= 8 for c in ok + [r.candidate for r in rejected])
    reasons = {r.reason for r in rejected}
    assert "tensor=8 does not divide kv_heads 4" in reasons
    # A batch of 12 rows splits over 4 data ranks but not 8 or 16.
    ok, rejected = enumerate_space(config, BatchShape(12, 32, 0), 16, 8, "dense", ("bfloat16",))
    assert {c.data for c in ok} <= {1, 2, 4}
    assert "the global batch of 12 rows does not split over 8 data ranks" in {r.reason for r in rejected}
    # cuDNN attention splits no row: context parallelism reaches it through Ulysses, where each
    # tensor rank's query heads split over the context ranks (kv heads repeated where fewer), and
    # is refused with the reason elsewhere.
    ok, _ = enumerate_space(config, BatchShape(16, 32, 0), 16, 8, "cudnn", ("bfloat16",))
    assert {"DP+CP2", "DP+CP4", "DP+TP2+CP2", "DP+TP2+CP4"} <= {c.kind for c in ok}
    two_heads = get_config("llama-tiny", {"num_heads": 2, "num_kv_heads": 2})
    _, rejected = enumerate_space(two_heads, BatchShape(16, 32, 0), 16, 8, "cudnn", ("bfloat16",))
    assert any(r.reason == "context parallel reaches cuDNN's attention only through Ulysses, which needs the 2 "
               "query heads of each tensor rank to split over context=4" for r in rejected)


def test_data_replicas_are_planned_with_whole_or_zero1_moments_and_priced_so():
    """Where there are data replicas the space holds each layout with AdamW's moments whole on every
    replica and split over them (ZeRO-1); the split one holds a replica's share of the moments and
    syncs gradients as a reduce-scatter and an all-gather."""
    import dataclasses

    from xlaopt.planning.price import memory_parts, software
    from xlaopt.planning.shapes import analytic_shape

    config = get_config("llama-tiny")
    ok, _ = enumerate_space(config, BatchShape(16, 32, 0), 8, 8, "dense", ("bfloat16",))
    assert not any(c.sharded_optimizer for c in ok if c.dp == 1)
    twins = {dataclasses.replace(c, sharded_optimizer=False) for c in ok if c.sharded_optimizer}
    assert twins and twins <= set(ok) and all(c.dp > 1 for c in twins)
    dp8 = next(c for c in twins if c.dp == 8 and c.tp == 1 and c.cp == 1 and c.remat == "none")
    shape = analytic_shape(config)
    whole, split = (memory_parts(c, shape, BatchShape(16, 32, 0), True)
                    for c in (dp8, dataclasses.replace(dp8, sharded_optimizer=True)))
    params = shape.layers * shape.layer_params + shape.embedding_params
    assert whole["state"] == pytest.approx(12.0 * params) and split["state"] == pytest.approx((4.0 + 8.0 / 8) * params)
    assert software(dataclasses.replace(dp8, sharded_optimizer=True), "gpu", 8, 4).sharded_optimizer


def test_space_holds_pipeline_stages_with_their_micro_batches_and_reasons():
    """Stages are the outermost mesh axis; a pipeline's micro-batches are multiples of its
    stages that split each data rank's rows; FSDP candidates come with each stage's weights
    gathered per tick and once a step, and with each virtual stage count that cuts a stage's
    layers evenly (llama-tiny's 2 a stage into 1 or 2 chunks); what cannot be built says why."""
    config = get_config("llama-tiny")  # 4 layers
    ok, rejected = enumerate_space(config, BatchShape(16, 32, 0), 16, 8, "cudnn", ("bfloat16",), stages=(1, 2, 8))
    staged = [c for c in ok if c.pp > 1]
    assert {c.pp for c in staged} == {2} and all(c.num_devices == 16 for c in staged)
    assert all(c.micro_batches % c.pp == 0 and (16 // c.data) % c.micro_batches == 0 for c in staged)
    assert {c.micro_batches for c in staged if c.data == 8} == {2}  # 2 rows a data rank
    assert {c.weights_once for c in staged if c.fsdp > 1} == {False, True}
    assert not any(c.weights_once for c in staged if c.fsdp == 1)
    assert staged[0].mesh.size("stage") == 2 and "+PP2" in staged[0].kind
    assert {c.virtual_stages for c in staged} == {1, 2} and {c.virtual_stages for c in ok if c.pp == 1} == {1}
    assert " pp=2 v=2 " in str(next(c for c in staged if c.virtual_stages == 2))
    # 1F1B beside GPipe where the family's loss runs inside the stack, interleaved over virtual stages.
    assert {(c.schedule, c.virtual_stages) for c in staged} == {("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("1f1b", 2)}
    assert " pp=2 1f1b " in str(next(c for c in staged if c.schedule == "1f1b" and c.virtual_stages == 1))
    assert " pp=2 1f1b v=2 " in str(next(c for c in staged if c.schedule == "1f1b" and c.virtual_stages == 2))
    assert not any(c.pp > 1 and c.schedule == "1f1b" for c in enumerate_space(
        get_config("vit-tiny"), BatchShape(16, 64, 0), 16, 8, "dense", ("bfloat16",), stages=(2,))[0])
    reasons = {r.reason for r in rejected}
    assert "8 pipeline stages do not divide the model's 4 layers (2, 4 do)" in reasons
    _, rejected = enumerate_space(config, BatchShape(16, 32, 0), 16, 8, "dense", ("bfloat16",), stages=(2,),
                                  target="cpu")
    assert {r.reason for r in rejected if r.candidate.fsdp == 8} == {
        "a pipeline in bfloat16 aborts XLA:CPU's compile on jax 0.10.2 (the GPU target builds it)"}


def test_cosmos3_analytic_shape_counts_the_model_flops():
    """Two towers' weights per layer, one tower per token, the rows' attention pairs and the LM
    head on text tokens only: the analytic shape's forward FLOPs are the model's (flops.py)."""
    from xlaopt.models.flops import forward_flops
    from xlaopt.planning.shapes import analytic_shape

    c = get_config("cosmos3-nano")
    n_text, n_gen = 896.0, 44160.0
    pairs = n_gen * (n_text + n_gen) + n_text * (n_text + 1) / 2  # one sample: the two-way mask's pairs
    shape = analytic_shape(c, pairs, n_text / (n_text + n_gen))
    tokens = n_text + n_gen
    analytic = (c.num_layers * (shape.linear_forward_flops(tokens) + shape.attention_forward_flops(1, 0))
                + shape.head_forward_flops(tokens))
    model = float(forward_flops(c, n_text, n_gen))  # also counts the generator's input/output projections
    assert 0.995 < analytic / model <= 1.0
    assert shape.layer_params == 2 * sum(shape.layer_matmuls())  # both towers' weights are gathered


def test_a_cnn_is_planned_data_parallel_or_fsdp_sharded_only():
    config = get_config("resnet50")
    ok, rejected = enumerate_space(config, BatchShape(512, 1, 0), 16, 8, "dense", ("bfloat16",))
    assert {c.kind for c in ok} == {"DP", "HSDP", "FSDP"} and {c.remat for c in ok} == {"none"}
    assert {r.reason for r in rejected} == {
        "a CNN has no heads, MLP or sequence to split: the rule table maps its channels to fsdp only",
        "a CNN has no layer stack to recompute"}


@pytest.mark.parametrize("name", ["resnet50", "vit-b16"])
def test_image_models_analytic_shapes_count_the_model_flops(name):
    """A ResNet's convolutions as layers of their mean size, a ViT as one tower over its patches:
    the analytic forward FLOPs and parameters are the model's."""
    from xlaopt import api
    from xlaopt.families import family_of
    from xlaopt.planning.shapes import analytic_shape
    from xlaopt.step import param_count

    c = get_config(name)
    shape, row = analytic_shape(c), family_of(c).default_batch(c).text_len
    analytic = (shape.layers * (shape.linear_forward_flops(row) + shape.attention_forward_flops(1, row))
                + shape.head_forward_flops(row))
    model = family_of(c).train_flops(c, family_of(c).synthetic(c, BatchShape(1, row, 0), 0).batch(0)) / 3
    assert 0.99 < analytic / model < 1 + 1e-9  # ViT: the patch embedding is not a layer
    assert 0.98 < shape.params / param_count(api.build_program(name)) < 1.02


@pytest.mark.parametrize("model", ["llama-tiny", "cosmos3-tiny"])
def test_traced_residuals_are_the_formula_where_it_is_exact_and_more_without_recomputation(model):
    """What the layer stack saves per token, traced from the jaxpr: the layer input alone under
    `full`, exactly the matmul outputs the formula counts under `dots`, and without
    recomputation at least 1.5x the formula (autodiff also keeps the rotated queries and keys, the
    attention's residuals and the MLP activation's coefficients), which is why the planner traces
    it rather than trusting the formula.
    With segment-aware attention, whose flash recurrence keeps no logits (dense attention's
    `dots` also keep the attention logits, which the formula leaves out)."""
    from xlaopt.execution import ExecutionConfig
    from xlaopt.planning.price import saved_per_token_layer
    from xlaopt.planning.residuals import saved_bytes_per_token_layer
    from xlaopt.planning.shapes import analytic_shape
    from xlaopt.program import TrainProgram, TrainSettings

    config = get_config(model)
    row = BatchShape(4, 32, 0) if config.family == "decoder" else BatchShape(4, 16, 48)
    program = TrainProgram(config, settings=TrainSettings(batch=row), execution=ExecutionConfig(attention="segment"))
    traced = saved_bytes_per_token_layer(program, "bfloat16")
    assert saved_bytes_per_token_layer(program, "float16") == traced  # the planner traces one for both
    formula = saved_per_token_layer(analytic_shape(config, 1.0), tp=1, compute=2)
    assert traced["full"] == formula["full"] == 2 * config.d_model
    assert traced["dots"] == formula["dots"]
    assert traced["none"] >= 1.5 * formula["none"]


@needs_devices(8)
def test_plan_ranks_compiles_writes_a_layout_that_verifies(tmp_path, capsys):
    out, layout = tmp_path / "plan.json", tmp_path / "best.toml"
    assert main(["plan", *LLAMA, "--topology", "cpu:1x8", "--top", "1", "--json", str(out), "--out", str(layout)]) == 0
    result = json.loads(out.read_text())
    assert result["method"] == "compiled (cpu target)" and result["target"] == "cpu"
    best, ranked = result["best"], result["candidates"]
    assert best["method"] == "compiled" and ranked[0]["candidate"] == best["candidate"]
    assert isinstance(best["memory_per_device_bytes"], float) and best["step_time_s"] > 0
    assert result["baseline"]["candidate"].startswith("dp=1 fsdp=8 tp=1 cp=1")
    assert result["baseline"]["method"] == "compiled"
    compiled = [c for c in ranked if c["method"] == "compiled"]
    assert [c["step_time_s"] for c in compiled] == sorted(c["step_time_s"] for c in compiled)
    assert all(c["reason"] for c in ranked[1:]) and result["counts"]["fit"] == len(ranked)
    assert result["best_speedup_over_baseline"] >= 1.0  # the baseline is compiled too, so ranked by that price
    planned = load_layout(layout)
    assert planned.model == "llama-tiny" and planned.topology == "cpu:1x8"
    assert planned.mesh.num_devices == 8 and planned.batch.batch_size == result["batch"]["global_batch"]
    # The planned layout's `analyze` is its plan: the planner priced it after the same passes.
    assert main(["analyze", *LLAMA, "--layout", str(layout), "--topology", "cpu:1x8",
                 "--json", str(tmp_path / "analyze.json")]) == 0
    assert json.loads((tmp_path / "analyze.json").read_text())["step_time_s"] == pytest.approx(best["step_time_s"])
    capsys.readouterr()
    # It runs: verify loads the layout file and steps it against one device (`train --layout`:
    # test_layout's HSDP layout).
    assert main(["verify", *LLAMA, "--layout", str(layout), "--dtype", "float32"]) == 0
    assert "ok" in capsys.readouterr().out


def test_resharding_counts_what_each_device_must_read():
    """fsdp=8 -> fsdp=4 on the first 4 devices: new device i holds old blocks 2i and 2i+1 of each
    sharded dimension; device 0 already holds block 0, the others none of theirs."""
    import jax

    from xlaopt.layout import Layout
    from xlaopt.mesh import MeshSpec
    from xlaopt.planning.replan import resharding
    from xlaopt.program import TrainProgram
    from xlaopt.step import abstract_params_with_axes

    config = get_config("llama-tiny")
    old, new = Layout(MeshSpec.parse("fsdp=8")), Layout(MeshSpec.parse("fsdp=4"))
    r = resharding(old, new, config)
    params, logical = abstract_params_with_axes(TrainProgram(config))
    sharded = replicated = 0
    for leaf, axes in zip(jax.tree.leaves(params), jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))):
        n = int(np.prod(leaf.shape))
        if "embed" in tuple(axes):  # the default table shards only the model dimension over fsdp
            sharded += n
        else:
            replicated += n
    assert r["bytes_moved_per_device_max"] == 12 * sharded / 4  # devices 1..3 read all of their new shard
    assert r["bytes_moved_per_device_mean"] == 12 * (sharded / 4 * 4 - sharded / 8) / 4
    assert r["state_bytes_per_device_new_max"] == 12 * (sharded / 4 + replicated)


@pytest.mark.parametrize("argv, message", [
    (["--model", "cosmos3-super", "--topology", "h100:1x8", "--mix", "cosmos3-720p", "--target", "cpu"],
     "cosmos3-super does not fit on h100:1x8 with any layout"),
    # 7 rows split over one data rank only, which leaves tensor=8 (kv_heads 4 does not split) or a
    # context split of 33 tokens: none works.
    ([*LLAMA, "--topology", "cpu:1x8", "--global-batch", "7", "--seq", "33"],
     "the nearest global batch that works is 6 rows"),
    (["--topology", "cpu:1x8"], "--model is required"),
    ([*LLAMA, "--topology", "a100:1x8", "--precision", "fp8", "--top", "0"],
     "precision fp8: A100 SXM 80GB has no fp8 matmuls; they run on Hopper GPUs (h100, h200 topologies)"),
    ([*LLAMA, "--topology", "h100:1x8", "--precision", "bf16", "--top", "0"],
     "--precision bf16: precisions are bfloat16, float16, fp8"),
])
def test_plan_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_past_top_the_planner_compiles_on_only_what_could_still_win():
    """The analytic model does not see XLA's scheduler holding prefetches back near the memory
    limit: a policy that saves more can compile slower than it priced. Past `top`, a candidate is
    compiled only if its analytic price, scaled by how far compiling its policy was off (1 for a
    policy not compiled yet), beats the best compiled price."""
    from xlaopt.planning.planner import Priced, _compile_best
    from xlaopt.planning.price import AnalyticPrice
    from xlaopt.planning.space import Candidate

    def priced(fsdp, remat, analytic_s, compiled_s):
        p = Priced(Candidate(8 // fsdp, fsdp, 1, 1, remat), AnalyticPrice(analytic_s, None, 2**30, {}))
        p.compiled_s = compiled_s
        return p

    fits = [priced(8, "minimal_with_context", 30.0, 40.0), priced(4, "minimal_with_context", 31.0, 41.0),
            priced(8, "full", 35.0, 36.0), priced(4, "full", 36.0, 37.0), priced(8, "none", 50.0, 20.0)]

    def compile_one(p):
        p.compiled = {"step_time_s": p.compiled_s, "memory_per_device_bytes": {"peak_estimate": 2**30}}

    chosen = _compile_best(fits, 1, False, 80 * 2**30, compile_one)
    # The HSDP twin of the first is 31 x 40/30 away (no better); full has not been compiled, so it
    # is; full's HSDP twin, 36 x 36/35, no longer beats 36 s, and none's 50 s never could.
    assert [(p.candidate.fsdp, p.candidate.remat) for p in chosen] == [(8, "minimal_with_context"), (8, "full")]


def test_candidates_that_differ_only_in_an_unneeded_fp16_are_shown_once_bf16_first():
    from xlaopt.planning.planner import Priced
    from xlaopt.planning.price import AnalyticPrice
    from xlaopt.planning.report import _with_twins, format_plan
    from xlaopt.planning.space import Candidate

    def priced(dtype, seconds, fsdp=8):
        return Priced(Candidate(8 // fsdp, fsdp, 1, 1, "full", 1, dtype), AnalyticPrice(seconds, None, 2**30, {}))

    ranked = [priced("bfloat16", 1.0), priced("float16", 1.0), priced("float16", 1.5, 4), priced("bfloat16", 2.0, 4)]
    rows = _with_twins([{"candidate": str(p.candidate), "kind": p.candidate.kind, "rank": i, "step_time_s":
                         p.step_time_s, "mfu": 0.5, "memory_per_device_bytes": 2**30, "method": "analytic",
                         "reason": ""} for i, p in enumerate(ranked, 1)], ranked)
    # fp16 pricing the same as its bf16 twin is marked; one that prices differently is not.
    assert [r.get("same_as") for r in rows] == [None, str(ranked[0].candidate), None, None]
    text = format_plan({"model": "m", "topology": "t", "devices": 8, "attention": "dense", "method": "analytic",
                        "batch": {"global_batch": 8, "row_tokens": 16}, "candidates": rows, "unfit": [],
                        "rejected": [], "baseline": None, "best": {**rows[0], "analytic_memory_per_device_bytes": 1},
                        "counts": {"space": 4, "fit": 4, "unfit": 0, "rejected": 0, "compiled": 0}, "seconds": 0.1})
    assert str(ranked[1].candidate) not in text and str(ranked[2].candidate) in text
    assert "(not shown: 1 candidate(s) pricing the same as a better-ranked twin" in text


def test_plan_over_the_recomputation_policies_asked_for():
    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.cli.plan import remats
    from xlaopt.planning.planner import plan
    from xlaopt.program import TrainProgram, TrainSettings

    assert remats("full, save_qkv_proj") == ("full", "save_qkv_proj") and remats(None) == ()
    program = TrainProgram(get_config("llama-tiny", {"num_layers": 2}), settings=TrainSettings(batch=BatchShape(8, 32, 0)))
    result = plan(program, parse_topology("cpu:1x8"), synthetic_batch(program), top=0, remats=("full", "save_qkv_proj"))
    assert {p.candidate.remat for p in result.ranked + result.unfit} == {"full", "save_qkv_proj"}


def test_the_plan_states_the_best_layout_for_each_stage_count(tmp_path, capsys):
    """llama-tiny (2 layers) on h100:2x4, stages 1, 2 and 4, analytic: each stage count gets its
    best candidate or the reason none can be built, in the JSON and the printout; a pipelined
    candidate's layout is a pipeline program (its micro-batches the pipeline's) that builds."""
    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.planning.planner import plan
    from xlaopt.program import TrainProgram, TrainSettings

    out = tmp_path / "plan.json"
    assert main(["plan", *LLAMA, "--topology", "h100:2x4", "--target", "cpu", "--top", "0", "--precision",
                 "float16", "--stages", "1,2,4", "--global-batch", "16", "--seq", "32", "--json", str(out)]) == 0
    rows = {row["stages"]: row for row in json.loads(out.read_text())["by_stages"]}
    assert rows[1]["rank"] == 1 and rows[2]["rank"] > 1 and " pp=2 " in rows[2]["candidate"]
    assert rows[4] == {"stages": 4, "rank": None, "reason": "none can be built: 4 pipeline stages do not divide "
                                                            "the model's 2 layers (2 do)"}
    assert f"2 stage(s): #{rows[2]['rank']} {rows[2]['candidate']}" in capsys.readouterr().out

    base = TrainProgram(get_config("llama-tiny", {"num_layers": 2}), settings=TrainSettings(batch=BatchShape(16, 32, 0)),
                        execution=ExecutionConfig(compute_dtype="float16"))
    result = plan(base, parse_topology("h100:2x4"), synthetic_batch(base), top=0, precisions=("float16",),
                  stages=(2,))
    program = result.program_for(result.best.candidate)
    assert program.mesh.size("stage") == 2 and program.execution.micro_batches == 1
    assert program.pipeline_schedule.microbatches == result.best.candidate.micro_batches
    assert program.pipeline_schedule.virtual_stages == result.best.candidate.virtual_stages


def test_a_plan_that_fits_nowhere_names_a_topology_where_the_same_plan_fits():
    """The larger topology the message names is searched over the plan's own space (its remat
    policies, stages): planned there with the same options, a layout fits."""
    import re

    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.build import build_program
    from xlaopt.errors import UserError
    from xlaopt.planning.planner import plan

    def planned(spec: str):
        topology = parse_topology(spec)
        program = build_program(get_config("llama3-70b"), batch=BatchShape(topology.num_devices, 4096, 0),
                                target="gpu", execution=ExecutionConfig(attention="cudnn"))
        return plan(program, topology, synthetic_batch(program), top=0, remats=("none",), precisions=("bfloat16",))

    with pytest.raises(UserError) as refused:
        planned("h100:1x8")
    named = re.search(r"the smallest h100 topology where a layout fits is (h100:\d+x8)", str(refused.value))
    assert named, refused.value
    assert planned(named.group(1)).best.analytic.memory_bytes <= parse_topology("h100:1x8").device.hbm_bytes

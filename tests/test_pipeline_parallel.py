"""Pipeline parallelism (`layer_stack=pipeline` over the mesh axis `stage`): the schedule's
arithmetic; steps equal to one device's with FSDP, tensor and context parallelism (and the passes
that rewrite them) inside the stages; the compiled step's stage-to-stage sends and each stage
holding only its own layers."""
import collections
import dataclasses
import json
import shutil
import signal
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec

from xlaopt.analysis import gpu_aot
from xlaopt.analysis.analyze import analyze, format_analysis
from xlaopt.analysis.hlo import collectives
from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.context import PassContext
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MESH_AXES, MeshSpec
from xlaopt.models.pipeline import PipelineSchedule
from xlaopt.models.registry import get_config
from xlaopt.passes.hierarchical_grads import HierarchicalGrads
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.runtime.verify import tolerance_key

from conftest import COSMOS3_TINY, LLAMA_TINY, check_pass, command_env, loop_state, needs_devices

PIPELINE = ExecutionConfig(compute_dtype="float32", layer_stack="pipeline")
ZERO1_1F1B = dataclasses.replace(PIPELINE, pipeline_microbatches=4, pipeline_schedule="1f1b", pipeline_virtual_stages=2,
                                 grad_reduce_dtype="bfloat16", grad_accumulate_dtype="bfloat16", sharded_optimizer=True)


def test_the_analytic_price_follows_the_spmd_loop():
    """The planner's price of xlaopt's pipeline (`Software(pipeline="spmd")`), llama3-8b on two
    stages of 8 H100: the bubble is P - 1 of the M + P - 1 ticks of one micro-batch's stage time;
    the head runs outside the stages (off the bubble, 1/P of every micro-batch's head on each
    device); a send follows every tick; with weights_once FSDP gathers a stage once a step, so
    its price does not grow with the micro-batches."""
    from xlaopt.analysis import analytic, costmodel as cm
    from xlaopt.planning.shapes import analytic_shape

    shape, h100 = analytic_shape(get_config("llama3-8b")), parse_topology("h100:2x8")
    P, M = 2, 4
    layout = analytic.Parallelism(dp=1, fsdp=8, tp=1, pp=P, cp=1, global_batch=32, seq_len=4096, micro_batch=1)
    assert layout.micro_batches == M
    price = lambda layout=layout, **kw: analytic.price_step(  # noqa: E731
        shape, layout, h100, analytic.Software(param_gather_bytes=4, grad_reduce_bytes=4, **kw), cm.FITTED)
    spmd, megatron = price(pipeline="spmd"), price(pipeline="megatron")
    head_s = (megatron.pipeline_bubble_s - spmd.pipeline_bubble_s) / (P - 1)  # Megatron's bubble holds the head
    assert head_s > 0 and megatron.compute_s - spmd.compute_s == pytest.approx(M * head_s * (1 - 1 / P))
    layers_s = spmd.compute_s - M * head_s / P + spmd.tp_exposed_s + spmd.cp_exposed_s + spmd.fsdp_exposed_s
    assert spmd.pipeline_bubble_s == pytest.approx((P - 1) / M * layers_s)
    assert spmd.pp_send_s / megatron.pp_send_s == pytest.approx((M + P - 1) / M)
    eight = dataclasses.replace(layout, micro_batch=layout.micro_batch / 2)  # 8 micro-batches of half the rows
    once = [price(lo, pipeline="spmd", pipeline_weights_once=True).fsdp_exposed_s for lo in (layout, eight)]
    per_tick = [price(lo, pipeline="spmd").fsdp_exposed_s for lo in (layout, eight)]
    assert once[0] == once[1] > 0 and per_tick[1] > per_tick[0]
    # Two virtual stages: half the bubble, a send after each of 2M + P - 1 ticks, and the stage's
    # fp32 weights (16 layers over fsdp=8) reordered across the network, half of them, each way.
    two = price(dataclasses.replace(layout, virtual_stages=2), pipeline="spmd")
    assert two.pipeline_bubble_s == pytest.approx(spmd.pipeline_bubble_s / 2)
    per_send = spmd.pp_send_s / (2 * (M + P - 1))
    reorder = cm.send_time_s(4 * 16 * shape.layer_params / 8 / 2, h100.levels[-1], cm.FITTED.network)
    assert two.pp_send_s == pytest.approx(2 * (2 * M + P - 1) * per_send + 2 * reorder)
    # 1F1B's loop: the head on the last stage, one micro-batch a tick, as Megatron's (so its
    # compute is Megatron's) but in none of the bubble's ticks (so its bubble is GPipe's), a
    # send each way after each of M + 2P - 2 ticks.
    one_f_one_b = price(pipeline="spmd-1f1b")
    assert one_f_one_b.pipeline_bubble_s == pytest.approx(spmd.pipeline_bubble_s)
    assert one_f_one_b.pipeline_bubble_s == pytest.approx(megatron.pipeline_bubble_s - (P - 1) * head_s)
    assert one_f_one_b.compute_s == pytest.approx(megatron.compute_s)
    assert one_f_one_b.pp_send_s == pytest.approx(2 * (M + 2 * P - 2) * per_send)
    # Interleaved over 2 virtual stages: half the bubble, a send each way after each of
    # 2M + 2P + P - 2 ticks, and the weights reordered as GPipe's rounds reorder them.
    interleaved = price(dataclasses.replace(layout, virtual_stages=2), pipeline="spmd-1f1b")
    assert interleaved.pipeline_bubble_s == pytest.approx(one_f_one_b.pipeline_bubble_s / 2)
    assert interleaved.pp_send_s == pytest.approx(2 * (2 * M + 3 * P - 2) * per_send + 2 * reorder)
    # and it holds min(M, 2P - 1) micro-batches' saves against GPipe's M + P - 1 ticks'; over V
    # virtual stages min(VM, 2VP - 1) chunks of 1 / V of a stage's layers.
    from xlaopt.planning.price import memory_parts
    from xlaopt.planning.space import Candidate

    eight_rows = BatchShape(64, 4096, 0)  # 8 micro-batches of one row on each of 8 FSDP ranks
    saved = {(name, v): memory_parts(Candidate(1, 8, 1, 1, remat="full", micro_batches=8, pp=P, schedule=name,
                                               virtual_stages=v), shape, eight_rows, dense_attention=False)["saved"]
             for name in ("gpipe", "1f1b") for v in (1, 2)}
    assert saved["1f1b", 1] / saved["gpipe", 1] == pytest.approx(min(8, 2 * P - 1) / (8 + P - 1))
    assert saved["1f1b", 2] / saved["1f1b", 1] == pytest.approx(min(2 * 8, 4 * P - 1) / 2 / min(8, 2 * P - 1))


def test_gpipe_runs_each_microbatch_on_each_stage_once_in_order():
    s = PipelineSchedule(stages=4, microbatches=8)
    assert s.ticks == 11 and s.bubble_fraction == pytest.approx(3 / 11) and s.saved_ticks == 11
    runs = {(p, t): s.microbatch_at(p, t) for p in range(4) for t in range(s.ticks)}
    for p in range(4):  # every stage runs every micro-batch once, in order, idle only in the bubble
        assert [runs[p, t] for t in range(s.ticks) if runs[p, t] is not None] == list(range(8))
        assert sum(runs[p, t] is None for t in range(s.ticks)) == 3
    for m in range(8):  # a micro-batch moves one stage per tick
        assert [t for p in range(4) for t in range(s.ticks) if runs[p, t] == m] == [m, m + 1, m + 2, m + 3]
    with pytest.raises(ValueError, match="multiple of the stages"):
        PipelineSchedule(stages=4, microbatches=6)


def test_virtual_stages_go_round_the_ring_with_a_v_times_smaller_bubble():
    """4 stages, 4 micro-batches, 2 virtual stages: every stage runs every (micro-batch, round)
    once; a round starts on stage 0 only after the last stage finished the one before (a tick
    later at the earliest, as the ring's send takes one); 11 ticks of half a stage's layers, the
    bubble 3 of them, against GPipe's 3 of 7 ticks of the whole stage."""
    P, M, V = 4, 4, 2
    s = PipelineSchedule(stages=P, microbatches=M, virtual_stages=V)
    assert s.ticks == V * M + P - 1 == 11 and s.bubble_fraction == pytest.approx(3 / 11)
    at = {(p, t): s.work_at(p, t) for p in range(P) for t in range(s.ticks)}
    for p in range(P):
        assert sorted(w for t in range(s.ticks) if (w := at[p, t]) is not None) == [(m, v) for m in range(M)
                                                                                   for v in range(V)]
    tick_of = {(p, w): t for (p, t), w in at.items() if w is not None}
    for m in range(M):
        for v in range(V):
            assert [tick_of[p, (m, v)] for p in range(P)] == list(range(tick_of[0, (m, v)], tick_of[0, (m, v)] + P))
            if v:
                assert tick_of[0, (m, v)] > tick_of[P - 1, (m, v - 1)]
    # The bubble in a stage's own time: 3 ticks of 1/V of its layers against GPipe's 3 whole.
    gpipe = PipelineSchedule(stages=P, microbatches=M)
    assert (s.ticks - V * M) / V == pytest.approx((gpipe.ticks - M) / 2)
    with pytest.raises(ValueError, match="use 1, 2, 4"):
        PipelineSchedule(stages=2, microbatches=2, virtual_stages=3).check_layers(8)


@needs_devices(4)
@pytest.mark.parametrize("stages,virtual", [(2, 3), (4, 2), (4, 5)])
def test_each_stage_gets_its_chunks_in_round_order(stages, virtual):
    """The weights' reorder, alone: stage p ends with chunks p, P + p, 2P + p, ... of the layers
    the rule table split contiguously, where V and P divide one another and where they do not."""
    import numpy as np
    from jax.sharding import Mesh

    from xlaopt.models.pipeline import _to_round_order

    layers = np.arange(stages * virtual * 2 * 3, dtype=np.float32).reshape(stages * virtual * 2, 3)  # chunks of 2
    mesh = Mesh(np.array(jax.devices()[:stages]), ("stage",))
    reorder = jax.jit(jax.shard_map(lambda w: _to_round_order(w, stages, virtual), mesh=mesh,
                                    in_specs=PartitionSpec("stage"), out_specs=PartitionSpec("stage")))
    chunks = layers.reshape(virtual, stages, 2, 3)  # [round v, stage p]: chunk vP + p
    assert np.array_equal(np.asarray(reorder(layers)), np.swapaxes(chunks, 0, 1).reshape(layers.shape))


# References shared with other files' (so their compiles are too): one device, float32, layers
# scanned: test_verify.py's for cosmos3-tiny, test_ulysses.py's for llama-tiny on 8 x 32 rows.
CASES = {  # name -> (model, mesh, batch, execution, pass options, passes that must apply)
    "llama-data-context-ulysses": (LLAMA_TINY, "stage=2,data=2,context=2", BatchShape(8, 32, 0), PIPELINE, None,
                                   {"ulysses-attention"}),
    # Data and context manual in the stages: the joint attention's Ulysses all-to-alls on each
    # device's chunks of both towers' sequences.
    "cosmos3-data-context-ulysses": (COSMOS3_TINY, "stage=2,data=2,context=2", None, PIPELINE, None,
                                     {"ulysses-attention"}),
    # 1F1B (the loss inside the loop, tick by tick): four stages, data manual, 8 micro-batches
    # (2P - 1 = 7 kept); and FSDP and tensor inside two stages, each stage's weights gathered once.
    "llama-1f1b-four-stages-eight-microbatches": (
        get_config("llama-tiny"), "stage=4,data=2", BatchShape(16, 32, 0),
        dataclasses.replace(PIPELINE, pipeline_microbatches=8, pipeline_schedule="1f1b"), None, set()),
    # Cosmos 3's tail: both final norms, the text head and the generator's outputs, the four
    # loss terms; the generator's output weights whole in the tail (split, XLA:CPU hung here).
    # Interleaved 1F1B: two rounds of the ring, chunks of one layer.
    "cosmos3-interleaved-1f1b-fsdp-tensor": (
        get_config("cosmos3-tiny", dict(num_layers=4)), "stage=2,fsdp=2,tensor=2", None,
        dataclasses.replace(PIPELINE, pipeline_microbatches=4, pipeline_schedule="1f1b", pipeline_virtual_stages=2),
        None, set()),
    # The weights' gradients summed over the ticks in bf16 (`grad_accumulate_dtype`), then over
    # data in bf16 (`grad_reduce_dtype`), each replica keeping its ZeRO-1 share, then reordered:
    # equal to one device within bf16's tolerance.
    "llama-interleaved-1f1b-data-tensor-bf16-grads-zero1": (
        get_config("llama-tiny"), "stage=2,data=2,tensor=2", BatchShape(8, 32, 0), ZERO1_1F1B, None, set()),
    "llama-1f1b-fsdp-tensor-weights-once": (
        get_config("llama-tiny"), "stage=2,fsdp=2,tensor=2", BatchShape(8, 32, 0),
        dataclasses.replace(PIPELINE, pipeline_microbatches=4, pipeline_schedule="1f1b", pipeline_weights_once=True),
        None, set()),
    # Two rounds of the ring (virtual stages): 4 layers in chunks of one, 4 micro-batches each
    # kept on stage 0 between rounds (M > P), each stage's weights gathered once and reordered;
    # and M = P, where a round's result is used at once.
    "llama-virtual-stages-fsdp-tensor-collective-matmul-weights-once": (
        get_config("llama-tiny"), "stage=2,fsdp=2,tensor=2", BatchShape(8, 32, 0),
        dataclasses.replace(PIPELINE, pipeline_microbatches=4, pipeline_weights_once=True, pipeline_virtual_stages=2),
        {"collective-matmul": {"enabled": True}}, {"collective-matmul"}),
    "cosmos3-virtual-stages-fsdp-tensor": (get_config("cosmos3-tiny", dict(num_layers=4)), "stage=2,fsdp=2,tensor=2",
                                           None, dataclasses.replace(PIPELINE, pipeline_virtual_stages=2), None, set()),
}
@needs_devices(8)
@pytest.mark.parametrize("case", CASES)
def test_pipelined_step_equals_one_device(case):
    config, mesh, batch, execution, options, applied = CASES[case]
    settings = TrainSettings(batch=batch) if batch else TrainSettings()
    program = TrainProgram(config, MeshSpec.parse(mesh), settings=settings, execution=execution)
    # Equal to one device (its layers scanned), and a second run of the passes changes nothing.
    laid, records = check_pass(program, options=options, dtype=tolerance_key(execution))
    assert {name for name, r in records.items() if r.changed} >= applied | {"mesh-layout"}, records


@needs_devices(8)
def test_stages_hold_their_own_layers_and_send_each_microbatch_on():
    """llama-tiny on stage=2,fsdp=2,tensor=2, 4 micro-batches: every stacked parameter is split
    over `stage` on its layers axis, nothing else is; in the compiled step the sends
    (collective-permutes between the two stages, one pair per group) run once per tick in the
    forward loop and once in the backward's, and over `stage` alone there is nothing else but
    the gathers of the stack's inputs, the reduce-scatter of its output, the all-reduces of
    the gradients of what every stage holds whole (embedding, norms) and the embedding
    gradient's one all-to-all."""
    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("stage=2,fsdp=2,tensor=2"),
                           settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                           execution=dataclasses.replace(PIPELINE, pipeline_microbatches=4))
    laid, _ = check_pass(program, reference=False)
    is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
    assert all(spec[0] == "stage" for spec in jax.tree.leaves(laid.shardings.state.params["layers"], is_leaf=is_spec))
    assert all("stage" not in spec for name, tree in laid.shardings.state.params.items() if name != "layers"
               for spec in jax.tree.leaves(tree, is_leaf=is_spec))

    ticks = PipelineSchedule(2, 4).ticks
    over_stage = [c for c in collectives(compile_program(laid).train_step.as_text(), laid.mesh.as_dict())
                  if c.mesh_axes == ("stage",)]
    sends = [c for c in over_stage if c.kind == "collective-permute"]
    assert sorted(c.executions for c in sends) == [ticks, ticks], [(c.name, c.executions) for c in sends]
    assert all(len(g) == 2 for c in sends for g in c.replica_groups)
    # and, once a step, the embedding gradient's rows moved to the table's FSDP split (an all-to-all
    # XLA runs over stage here: the rows were split over fsdp and stage, `layers.embedding_lookup`).
    assert {c.kind for c in over_stage} == {"collective-permute", "all-gather", "reduce-scatter", "all-reduce",
                                            "all-to-all"}
    assert [c.executions for c in over_stage if c.kind == "all-to-all"] == [1]

    # analyze states the schedule beside its price, and the bubble as priced: P - 1 of the ticks
    # of the step's two tick loops (forward and backward), each loop's time from the simulation.
    result = analyze(laid, parse_topology("cpu:1x8"))
    p = result["pipeline"]
    assert {k: p[k] for k in ("schedule", "stages", "microbatches", "virtual_stages", "ticks", "bubble_fraction",
                              "saved_ticks")} == {
        "schedule": "gpipe", "stages": 2, "microbatches": 4, "virtual_stages": 1, "ticks": ticks,
        "bubble_fraction": 1 / ticks, "saved_ticks": ticks}
    loops = {loop["name"]: loop for loop in result["schedule"]["loops"]}
    assert len(p["tick_loops"]) == 2 and all(loops[n]["trip_count"] == ticks for n in p["tick_loops"])
    assert p["tick_loops_s"] == pytest.approx(sum(loops[n]["time_s"] for n in p["tick_loops"]))
    assert 0 < p["tick_loops_s"] < result["step_time_s"] and p["bubble_s"] == pytest.approx(p["tick_loops_s"] / ticks)
    assert "pipeline: gpipe, 2 stages x 4 micro-batches: 5 ticks, the bubble 20.0%" in format_analysis(result)

    # hierarchical-grads' per-layer reduction would run once per tick under a pipeline: it says so.
    reason = HierarchicalGrads().why_not(laid, PassContext.for_program(laid, parse_topology("h100:2x4")))
    assert "once per tick" in reason


@needs_devices(8)
def test_virtual_stages_send_round_the_ring_once_a_tick():
    """llama-tiny (4 layers) on stage=2,fsdp=2,tensor=2 with 2 virtual stages, 4 micro-batches:
    the compiled step's sends over `stage` form a ring (stage 1 hands each round back to stage 0)
    and run once per tick, V M + P - 1 = 9 ticks, forward and backward; the weights' reorder into
    round order (and their gradients' back) are sends over `stage` once a step, point to point
    (the partitioner's own reorder was all-to-alls here, all-gathers of every stage's weights
    where V and P do not divide one another)."""
    config, mesh, batch, execution, _, _ = CASES["llama-virtual-stages-fsdp-tensor-collective-matmul-weights-once"]
    program = TrainProgram(config, MeshSpec.parse(mesh), settings=TrainSettings(batch=batch), execution=execution)
    laid, _ = run_pipeline(program, pipeline())
    over_stage = [c for c in collectives(compile_program(laid).train_step.as_text(), laid.mesh.as_dict())
                  if c.mesh_axes == ("stage",)]
    sends = [c for c in over_stage if c.kind == "collective-permute" and c.executions > 1]
    reorders = [c for c in over_stage if c.kind == "collective-permute" and c.executions == 1]
    assert len(reorders) > 2 and [c.kind for c in over_stage].count("all-to-all") <= 1  # the embedding gradient's
    assert program.pipeline_schedule.ticks == 9
    assert sends and all(c.executions == 9 for c in sends), [(c.name, c.executions) for c in sends]
    # (source, target) pairs: with two stages a ring sends both ways (GPipe's only 0 -> 1).
    assert all({(b, a) for a, b in c.replica_groups} == set(c.replica_groups) for c in sends)
    result = analyze(laid, parse_topology("cpu:1x8"))
    assert len(result["pipeline"]["tick_loops"]) == 2
    assert "pipeline: gpipe, 2 stages x 2 virtual stages x 4 micro-batches: 9 ticks, the bubble 11.1%" in \
        format_analysis(result)


@needs_devices(8)
def test_the_gradients_cross_data_once_a_step_not_once_a_tick():
    """llama-tiny on stage=2,data=4, 4 micro-batches: each data rank sums its weight gradients over
    the ticks and they are reduced over `data` once a step, outside the tick loops (left to the
    partitioner, every layer's gradients were all-reduced over data at each of the 5 backward
    ticks)."""
    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("stage=2,data=4"), settings=TrainSettings(batch=BatchShape(16, 32, 0)),
                           execution=dataclasses.replace(PIPELINE, pipeline_microbatches=4))
    laid, _ = run_pipeline(program, pipeline())
    over_data = [c for c in collectives(compile_program(laid).train_step.as_text(), laid.mesh.as_dict())
                 if "data" in c.mesh_axes]
    assert over_data and all(c.executions == 1 for c in over_data), [(c.name, c.executions) for c in over_data]


@needs_devices(8)
def test_under_zero1_the_1f1b_gradients_cross_the_stages_as_each_replicas_share():
    """Interleaved 1F1B on stage=2,data=2,tensor=2 (the case above, equal to one device) under
    ZeRO-1: each data replica keeps its share of every stacked weight's summed gradient, the one
    its moments update, before the gradients are reordered across the stages. The reorder moves
    half a stage's chunks (V = P = 2), so its sends, once a step, carry a quarter of a stage's
    stacked gradients fewer bytes than with whole moments (XLA:CPU sends them in f32)."""
    import math

    def once_a_step(sharded_optimizer: bool):
        program = TrainProgram(get_config("llama-tiny"), MeshSpec.parse("stage=2,data=2,tensor=2"),
                               settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                               execution=dataclasses.replace(ZERO1_1F1B, sharded_optimizer=sharded_optimizer))
        compiled = compile_program(run_pipeline(program, pipeline())[0])
        found = collectives(compiled.train_step.as_text(), compiled.program.mesh.as_dict())
        return sum(c.bytes for c in found if c.kind == "collective-permute" and c.executions == 1), compiled

    (whole, _), (shares, compiled) = once_a_step(False), once_a_step(True)
    stacked = jax.tree.leaves(compiled.abstract_state.params["layers"])
    stage_bytes = sum(4 * math.prod(w.sharding.shard_shape(w.shape)) for w in stacked)
    assert whole - shares == stage_bytes // 4, (whole, shares, stage_bytes)


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_on_the_gpu_target_sends_are_async_and_cudnn_runs_in_a_stage():
    """Deviceless H100 compile of llama-tiny on stage=2,tensor=2 (4 micro-batches): each
    stage-to-stage send is an async collective-permute (start and done, the scheduler free to
    place compute between them), once per tick forward and backward. With attention=cudnn the
    stages run cuDNN's fused kernels: JAX's cuDNN call in a shard_map manual over `stage` alone
    fails its custom partitioning on the installed jax (checked here), and runs once the call is
    manual over every axis (`cudnn_attention`), forward and backward."""
    import jax.numpy as jnp

    from xlaopt.models.cudnn_attention import BACKWARD_TARGET, FORWARD_TARGET, _local
    from xlaopt.models.masks import Tokens

    topology = parse_topology("h100:1x4")

    def compiled(attention: str) -> tuple[str, TrainProgram]:
        program = TrainProgram(LLAMA_TINY, MeshSpec.parse("stage=2,tensor=2"), target="gpu",
                               settings=TrainSettings(batch=BatchShape(8, 128, 0)),
                               execution=ExecutionConfig(layer_stack="pipeline", attention=attention,
                                                         pipeline_microbatches=4))
        laid, _ = run_pipeline(program, pipeline())
        mesh = gpu_aot.gpu_mesh(topology, laid.mesh.sizes, MESH_AXES, laid.mesh.placement())
        return compile_program(laid, mesh).train_step.as_text(), laid

    text, laid = compiled("dense")
    sends = [c for c in collectives(text, laid.mesh.as_dict()) if c.kind == "collective-permute"]
    assert sorted(c.executions for c in sends) == [PipelineSchedule(2, 4).ticks] * 2
    assert all(c.is_async and c.mesh_axes == ("stage",) for c in sends)

    text, _ = compiled("cudnn")
    assert f'custom_call_target="{FORWARD_TARGET}"' in text and f'custom_call_target="{BACKWARD_TARGET}"' in text

    def attend(q, k, v, seg):  # the cuDNN call as it was: partly manual
        tokens = Tokens.of(seg, jnp.zeros_like(seg, bool))
        return _local(q, k, v, tokens, tokens, 4)

    mesh = gpu_aot.gpu_mesh(topology, MeshSpec.parse("stage=2,tensor=2").sizes, MESH_AXES)
    qkv = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.bfloat16)
    stage = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                                  axis_names={"stage"}, check_vma=False))
    with pytest.raises(Exception, match="custom_partitioner"):
        stage.lower(qkv, qkv, qkv, jax.ShapeDtypeStruct((2, 128), jnp.int32)).compile()


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_on_the_gpu_target_1f1b_gradients_cross_data_and_the_stages_in_bfloat16():
    """Interleaved 1F1B on stage=2,data=2 with `grad_reduce_dtype=bfloat16`, deviceless H100s: the
    weights' gradients are summed over data in bf16 once a step, then reordered across the
    stages in bf16 (what crossed data, half fp32's bytes); refused for GPipe's loop, whose
    gradients the partitioner reduces. With `grad_accumulate_dtype=bfloat16` the tick loop
    carries the accumulators in bf16: every float32 array it carried of a chunk's weights' shape
    becomes bf16."""
    from xlaopt.step import abstract_state, why_not_accumulated_by_xlaopt, why_not_reduced_by_xlaopt

    def laid_out(schedule: str) -> TrainProgram:
        program = TrainProgram(get_config("llama-tiny", {"num_layers": 4}), MeshSpec.parse("stage=2,data=2"),
                               target="gpu", settings=TrainSettings(batch=BatchShape(8, 128, 0)),
                               execution=ExecutionConfig(layer_stack="pipeline", pipeline_microbatches=4,
                                                         pipeline_schedule=schedule, pipeline_virtual_stages=2,
                                                         grad_reduce_dtype="float32"))
        return run_pipeline(program, pipeline())[0]

    assert "GPipe" in why_not_reduced_by_xlaopt(laid_out("gpipe"))
    laid = laid_out("1f1b")
    assert why_not_reduced_by_xlaopt(laid) is None
    laid = laid.replace(execution=dataclasses.replace(laid.execution, grad_reduce_dtype="bfloat16"))
    mesh = gpu_aot.gpu_mesh(parse_topology("h100:1x4"), laid.mesh.sizes, MESH_AXES, laid.mesh.placement())
    found = collectives(compile_program(laid, mesh).train_step.as_text(), laid.mesh.as_dict())
    dtypes = lambda c: {dtype for dtype, _ in c.shapes}  # noqa: E731
    summed = [c for c in found if c.kind == "all-reduce" and c.mesh_axes == ("data",) and c.bytes > 1024]
    assert summed and all(dtypes(c) == {"bf16"} for c in summed), summed
    # Once a step across the stages: the weights' bf16 casts forward, their summed gradients back.
    reordered = [c for c in found if c.kind == "collective-permute" and c.executions == 1 and c.bytes > 1024]
    assert any(dtypes(c) == {"bf16"} for c in reordered) and not any(dtypes(c) == {"f32"} for c in reordered), \
        [(c.bytes, dtypes(c)) for c in reordered]
    assert "GPipe" in why_not_accumulated_by_xlaopt(laid_out("gpipe")) and why_not_accumulated_by_xlaopt(laid) is None
    narrow = laid.replace(execution=dataclasses.replace(laid.execution, grad_accumulate_dtype="bfloat16"))
    ticks = 2 * 4 + 2 * 2 + 2 - 2  # V M + V P + P - 2
    state = {p: loop_state(compile_program(p, mesh).train_step.as_text(), ticks) for p in (laid, narrow)}
    # One accumulator a stacked weight, [V, k / V, ...] (a stage's 2 of the 4 layers in 2 chunks),
    # and one for each of the tail's: the final norm's and the head's (llama-tiny: d_model 256).
    chunks = collections.Counter(",".join(map(str, (2, 1, *w.shape[1:])))
                                 for w in jax.tree.leaves(abstract_state(laid).params) if w.shape[:1] == (4,))
    chunks.update(["256", "256,4096"])
    assert state[laid] - state[narrow] == collections.Counter({("f32", dims): n for dims, n in chunks.items()})
    assert state[narrow] - state[laid] == collections.Counter({("bf16", dims): n for dims, n in chunks.items()})


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_on_the_gpu_target_fsdp_weights_are_gathered_once_a_step_when_asked():
    """llama-tiny (4 layers) on stage=2,fsdp=4, 4 micro-batches, deviceless H100s: by default XLA
    gathers each stage's FSDP-split weights, and reduce-scatters their gradients, at every tick
    (5 a step); with pipeline_weights_once, every FSDP all-gather and reduce-scatter runs once a
    step and the bytes over `fsdp` fall."""
    topology = parse_topology("h100:1x8")

    def over_fsdp(once: bool):
        program = TrainProgram(get_config("llama-tiny"), MeshSpec.parse("stage=2,fsdp=4"), target="gpu",
                               settings=TrainSettings(batch=BatchShape(16, 128, 0)),
                               execution=ExecutionConfig(layer_stack="pipeline", attention="dense", pipeline_microbatches=4,
                                                         pipeline_weights_once=once))
        laid, _ = run_pipeline(program, pipeline())
        mesh = gpu_aot.gpu_mesh(topology, laid.mesh.sizes, MESH_AXES, laid.mesh.placement())
        return [c for c in collectives(compile_program(laid, mesh).train_step.as_text(), laid.mesh.as_dict(), topology)
                if c.mesh_axes == ("fsdp",)]

    ticks = PipelineSchedule(2, 4).ticks
    per_tick, once = over_fsdp(False), over_fsdp(True)
    for kind in ("all-gather", "reduce-scatter"):
        assert any(c.kind == kind and c.executions == ticks for c in per_tick), [(c.kind, c.executions) for c in per_tick]
        assert all(c.executions == 1 for c in once if c.kind == kind), [(c.kind, c.executions) for c in once]
    assert sum(c.total_bytes for c in once) < sum(c.total_bytes for c in per_tick)


@needs_devices(8)
def test_a_pipelined_run_resumes_on_a_layout_without_stages(tmp_path):
    """The parameter tree is every strategy's: a run checkpointed on stage=2,fsdp=2,tensor=2
    continues on fsdp=4,tensor=2 with its layers scanned, on the losses the pipelined run had."""
    from xlaopt.cli import main
    from xlaopt.runtime.verify import TOLERANCES

    def train(name, *args):
        out = tmp_path / f"{name}.json"
        assert main(["train", "--model", "llama-tiny", "--set", "num_layers=2", "--no-progress", "--steps", "4",
                     "--dtype", "float32", "--ckpt", str(tmp_path / "ckpt"), "--json", str(out), *args]) == 0
        return json.loads(out.read_text())

    first = train("first", "--mesh", "stage=2,fsdp=2,tensor=2", "--exec", "layer_stack=pipeline", "--ckpt-every", "2")
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")
    rest = train("rest", "--mesh", "fsdp=4,tensor=2", "--resume")
    assert first["mesh"]["stage"] == 2 and rest["mesh"]["stage"] == 1
    assert rest["checkpoint"]["resumed_from"] == 2 and [s["step"] for s in rest["steps"]] == [2, 3]
    for got, want in zip(rest["steps"], first["steps"][2:]):
        assert abs(got["loss"] - want["loss"]) <= TOLERANCES["float32"][0] * abs(want["loss"])


# The refused program, built with the check bypassed, compiled in a process of its own.
_BF16_ON_CPU = """
from xlaopt.mesh import MeshSpec, request_cpu_devices
request_cpu_devices(2)
from xlaopt.compile import compile_program
from xlaopt.execution import ExecutionConfig
from xlaopt.models.registry import get_config
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram
TrainProgram._check_pipeline = lambda self: None
program = TrainProgram(get_config("llama-tiny", {"num_layers": 2}), MeshSpec.parse("stage=2"),
                       execution=ExecutionConfig(layer_stack="pipeline", compute_dtype="bfloat16"))
compile_program(run_pipeline(program, pipeline())[0]).grads
print("compiled")
"""


@pytest.mark.slow  # a process of its own
def test_xla_cpu_aborts_compiling_a_bfloat16_pipeline():
    """The fact behind refusing layer_stack=pipeline in bfloat16 on the cpu target: on the
    installed jax the process dies (SIGABRT) inside XLA:CPU's compile, with no message."""
    with pytest.raises(UserError, match="in bfloat16 aborts XLA:CPU's compile"):
        TrainProgram(LLAMA_TINY, MeshSpec.parse("stage=2"), execution=dataclasses.replace(PIPELINE, compute_dtype="bfloat16"))
    done = subprocess.run([sys.executable, "-c", _BF16_ON_CPU], capture_output=True, text=True, timeout=600,
                          env=command_env())
    assert done.returncode == -signal.SIGABRT and "compiled" not in done.stdout, (done.returncode, done.stderr[-2000:])

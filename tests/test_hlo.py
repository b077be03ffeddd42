"""Collectives read from compiled HLO: groups, mesh axes, link levels, and bytes that equal
the analytic volumes (scaling-book) for data-parallel and FSDP layouts of the tiny model."""
import dataclasses
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from suite_compile import fast_executable_text

from xlaopt.analysis.hlo import collectives, parse_replica_groups
from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram
from xlaopt.step import abstract_params_with_axes

from conftest import COSMOS3_TINY, command_env, needs_devices


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,1},{2,3}}, dims", ((0, 1), (2, 3))),
    ("replica_groups=[2,4]<=[8], x", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=[4,2]<=[2,4]T(1,0), x", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, x", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, x", ((0, 1, 2, 3), (4, 5, 6, 7))),
    # device_ids give the order of devices over the mesh: here [[0,2,4,6],[1,3,5,7]].
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, x",
     ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("source_target_pairs={{0,1},{1,0}}", ((0, 1), (1, 0))),
    # send / recv carry their pairs as a frontend attribute
    ('frontend_attributes={_xla_send_recv_source_target_pairs="{{0,1},{1,2}}"}', ((0, 1), (1, 2))),
])
def test_replica_group_spellings(attrs, groups):
    assert parse_replica_groups(attrs) == groups


# Every async spelling of a collective, each also inside a while loop of 3 trips: the two
# `-start` opcodes XLA keeps and `async-start`s whose called computation holds the collective.
ASYNC_HLO = """HloModule async_collectives

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (p: f32[8,16]) -> f32[4,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %rs = f32[4,16]{1,0} reduce-scatter(%p), channel_id=1, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

%wrapped_a2a (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%p), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%t), index=1
  %body-rs-start = ((f32[8,16]{1,0}), f32[4,16]{1,0}) async-start(%x), calls=%wrapped_rs
  %body-rs-done = f32[4,16]{1,0} async-done(%body-rs-start)
  %body-ar-start = f32[8,16]{1,0} all-reduce-start(%x), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  %body-ar-done = f32[8,16]{1,0} all-reduce-done(%body-ar-start)
  ROOT %next = (s32[], f32[8,16]{1,0}) tuple(%i, %body-ar-done)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %ag-start = (f32[8,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%x), channel_id=4, replica_groups={{0,1}}, dimensions={0}
  %ag-done = f32[16,16]{1,0} all-gather-done(%ag-start)
  %cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)
  %a2a-start = ((f32[8,16]{1,0}), f32[8,16]{1,0}) async-start(%cp-done), calls=%wrapped_a2a
  %a2a-done = f32[8,16]{1,0} async-done(%a2a-start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %a2a-done)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_async_collectives_are_read_once_at_their_start():
    colls = {c.name: c for c in collectives(ASYNC_HLO)}
    # one per start, never the done, and nothing read a second time inside a wrapped computation
    assert set(colls) == {"ag-start", "cp-start", "a2a-start", "body-rs-start", "body-ar-start"}
    assert all(c.is_async for c in colls.values())
    assert {n: c.kind for n, c in colls.items()} == {
        "ag-start": "all-gather", "cp-start": "collective-permute", "a2a-start": "all-to-all",
        "body-rs-start": "reduce-scatter", "body-ar-start": "all-reduce"}
    # bytes, scaling-book: a gather its result, a scatter its operand (4 x 16 x 4 bytes x 2 ranks)
    assert colls["ag-start"].bytes == 16 * 16 * 4 and colls["body-rs-start"].bytes == 8 * 16 * 4
    assert colls["a2a-start"].bytes == colls["cp-start"].bytes == colls["body-ar-start"].bytes == 8 * 16 * 4
    assert colls["a2a-start"].replica_groups == ((0, 1, 2, 3),)
    assert colls["a2a-start"].shapes == (("f32", (8, 16)),)  # the wrapped collective's result
    assert colls["cp-start"].replica_groups == ((0, 1), (1, 0))
    # executions come from the loop's trip count
    assert {n: c.executions for n, c in colls.items()} == {
        "ag-start": 1, "cp-start": 1, "a2a-start": 1, "body-rs-start": 3, "body-ar-start": 3}


def test_schedule_reads_the_same_collectives():
    from xlaopt.analysis.schedule import build_schedule

    ops = build_schedule(ASYNC_HLO).ops
    starts = [op for op in ops if op.kind == "collective-start"]
    read = {c.name: c for c in collectives(ASYNC_HLO)}
    assert sorted(op.name for op in starts) == sorted(n for n, c in read.items() for _ in range(c.executions))
    for op in starts:
        assert (op.collective.kind, op.collective.bytes, op.collective.replica_groups) == (
            read[op.name].kind, read[op.name].bytes, read[op.name].replica_groups)
    assert sum(op.kind == "collective-done" for op in ops) == len(starts)


def _compiled(config, mesh: str):
    program = TrainProgram(config, MeshSpec.parse(mesh), execution=ExecutionConfig(compute_dtype="float32"))
    program, _ = run_pipeline(program, pipeline())
    return program, compile_program(program).train_step.as_text()


def _param_bytes(program, where=lambda path, spec: True) -> int:
    params, _ = abstract_params_with_axes(program)
    specs = jax.tree.leaves(program.shardings.state.params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize
               for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs)
               if where(jax.tree_util.keystr(path), spec))


def _array_bytes(colls):
    """Bytes per step excluding rank-0 results (loss terms and token counts)."""
    return sum((c.bytes - c.scalar_bytes) * c.executions for c in colls)


@needs_devices(8)
def test_data_parallel_all_reduces_exactly_the_gradients(tiny_config):
    program, text = _compiled(tiny_config, "data=8")
    colls = collectives(text, program.mesh.as_dict())
    assert {c.kind for c in colls} == {"all-reduce"}
    assert {c.mesh_axes for c in colls} == {("data",)}
    # Scaling book: data parallelism all-reduces every gradient once per step (fp32 here).
    assert _array_bytes(colls) == _param_bytes(program)


@needs_devices(8)
def test_fsdp_gathers_each_layer_twice_and_reduces_gradients_once(tiny_config):
    program, text = _compiled(tiny_config, "fsdp=8")
    colls = collectives(text, program.mesh.as_dict())
    assert {c.mesh_axes for c in colls} == {("fsdp",)}
    gathers = [c for c in colls if c.kind == "all-gather"]
    sharded = lambda path, spec: "fsdp" in str(spec)
    layer_bytes = _param_bytes(program, lambda path, spec: sharded(path, spec) and "layers" in path)
    other_bytes = _param_bytes(program, lambda path, spec: sharded(path, spec) and "layers" not in path)
    # Scanned layers: each layer's weights are gathered for the forward and again for the backward.
    in_scan = [c for c in gathers if c.executions == tiny_config.num_layers]
    assert _array_bytes(in_scan) == 2 * layer_bytes
    # Weights outside the scan are gathered once or twice (XLA keeps some gathered copies alive).
    outside = _array_bytes([c for c in gathers if c.executions == 1])
    assert other_bytes <= outside <= 2 * other_bytes
    # The gradient reduction (on CPU an all-reduce plus a slice stands in for reduce-scatter), of
    # every parameter but the embedding tables (tokens, and Cosmos 3's three modalities): their
    # gradients are scattered into each device's shard of the table from the looked-up rows'
    # gradients, moved there by one all-to-all (`models/layers.embedding_lookup`), no
    # table-sized reduction.
    table = lambda path, spec: "'embed_ED'" in path or "'modality_embed_3D'" in path
    assert _param_bytes(program, table) == 4 * (tiny_config.vocab_size + 3) * tiny_config.d_model
    assert any(c.kind == "all-to-all" and c.executions == 1 for c in colls)
    assert (_array_bytes([c for c in colls if c.kind in ("all-reduce", "reduce-scatter")])
            == _param_bytes(program) - _param_bytes(program, table))
    shard = f"f32[{tiny_config.vocab_size},{tiny_config.d_model // 8}]"
    assert any(f"= {shard}" in line and " scatter(" in line for line in text.splitlines())


@needs_devices(8)
def test_groups_map_to_mesh_axes_and_link_levels(tiny_config):
    program, text = _compiled(tiny_config, "data=2,fsdp=2,tensor=2")
    two_nodes_of_four = dataclasses.replace(parse_topology("h100:2x4"))
    colls = collectives(text, program.mesh.as_dict(), two_nodes_of_four)
    axes = {c.mesh_axes for c in colls}
    assert ("fsdp",) in axes and ("tensor",) in axes and any("data" in a for a in axes)
    for c in colls:
        # data is the outermost mesh axis: only groups spanning it leave a node of four devices.
        if c.kind != "collective-permute":
            assert c.link_level == ("ib-400g" if "data" in c.mesh_axes else "nvlink4"), c
    fsdp_gathers = [c for c in colls if c.kind == "all-gather" and c.mesh_axes == ("fsdp",)]
    assert fsdp_gathers and all(len(g) == 2 for c in fsdp_gathers for g in c.replica_groups)


@needs_devices(4)
def test_tensor_parallel_all_reduces_one_activation_per_sharded_contraction(tiny_config):
    """Megatron-style TP on `tensor=4`: every matmul contracting a tensor-sharded dimension
    leaves partial sums that are all-reduced at activation size. Per tower and layer: the
    O and MLP-down outputs in the forward (2), the input gradients of Q, K, V, gate and up in
    the backward (5). (XLA all-reduces the Q/K/V and gate/up partials separately instead of
    summing them locally first: three reductions a hand-written layer would save.)"""
    program, text = _compiled(tiny_config, "tensor=4")
    colls = collectives(text, program.mesh.as_dict())
    assert {c.mesh_axes for c in colls} == {("tensor",)} and {c.kind for c in colls} == {"all-reduce"}
    B, T, V, D = 8, program.settings.batch.text_len, program.settings.batch.gen_len, tiny_config.d_model
    activations = {(B, T, D): 4 * B * T * D, (B, V, D): 4 * B * V * D}
    in_scan = sum(activations[dims] * c.executions for c in colls if c.executions == tiny_config.num_layers
                  for _, dims in c.shapes if dims in activations)
    assert in_scan == tiny_config.num_layers * 7 * sum(activations.values())


@needs_devices(8)
def test_cli_inspect_reports_collectives_by_axis_and_link(tmp_path, capsys):
    import json

    from xlaopt.cli import main

    out = tmp_path / "inspect.json"
    rc = main(["inspect", "--model", "llama-tiny", "--set", "num_layers=2", "--mesh", "data=2,fsdp=4",
               "--topology", "h100:2x4", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["topology"] == "h100:2x4"
    levels = {(g["mesh_axes"], g["link_level"]) for g in report["collective_groups"]}
    assert ("fsdp", "nvlink4") in levels  # fsdp groups stay inside a node of four
    assert all(level == "ib-400g" for axes, level in levels if "data" in axes)
    assert report["memory_per_device_bytes"]["arguments"] > 0 and report["comm_by_axis"]["fsdp"] > 0
    assert "all-gather" in capsys.readouterr().out
    assert main(["inspect", "--model", "llama-tiny", "--mesh", "data=8", "--topology", "h100:1x4"]) == 2


@needs_devices(8)
def test_the_suites_fast_compile_reads_the_users_hlo(tmp_path):
    """The suite runs executables compiled fast (suite_compile.py: LLVM -O0, XLA:CPU's elemental
    emitters), and every read of one is a user's compile: the optimised, scheduled HLO and the
    memory analysis of a process started without XLA_FLAGS (XLA's defaults), computation for
    computation and instruction for instruction; only the source locations they were traced from
    differ (another caller). The fast executable's own HLO differs (so the redirection is what
    makes the reads a user's)."""
    program, _ = _compiled(COSMOS3_TINY, "data=2,fsdp=2,tensor=2")
    compiled = compile_program(program).train_step
    user = tmp_path / "user.json"
    code = f"""if True:
        import json, jax
        from xlaopt.compile import compile_program
        from xlaopt.execution import ExecutionConfig
        from xlaopt.mesh import MeshSpec
        from xlaopt.models.registry import get_config
        from xlaopt.pipeline import pipeline, run_pipeline
        from xlaopt.program import TrainProgram
        program = TrainProgram(get_config("cosmos3-tiny", {{"num_layers": 2}}), MeshSpec.parse("data=2,fsdp=2,tensor=2"),
                               execution=ExecutionConfig(compute_dtype="float32"))
        step = compile_program(run_pipeline(program, pipeline())[0]).train_step
        open({str(user)!r}, "w").write(json.dumps(dict(text=step.as_text(),
                                                       temp=step.memory_analysis().temp_size_in_bytes)))"""
    env = command_env(devices=8, fast_compile=False)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8"]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    users = json.loads(user.read_text())
    body = lambda text: [re.sub(r", metadata=\{[^}]*\}", "", line)
                         for line in text[re.search(r"^(%|ENTRY)", text, re.M).start():].splitlines()]
    assert body(compiled.as_text()) == body(users["text"])
    assert compiled.memory_analysis().temp_size_in_bytes == users["temp"]
    assert " while(" in users["text"] and "all-gather" in users["text"]
    assert body(fast_executable_text(compiled)) != body(users["text"])

"""Collectives read from compiled HLO: groups, mesh axes, link levels, and bytes that equal
the analytic volumes (scaling-book) for data-parallel and FSDP layouts of the tiny model."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from xlaopt.compile import compile_program
from xlaopt.analysis.hlo import collectives, parse_replica_groups
from xlaopt.mesh import MeshSpec
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.step import abstract_params_with_axes
from xlaopt.analysis.topology import parse_topology

from conftest import needs_devices


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
])
def test_replica_group_spellings(attrs, groups):
    assert parse_replica_groups(attrs) == groups


def _compiled(config, mesh: str):
    program = TrainProgram(config, MeshSpec.parse(mesh), settings=TrainSettings(compute_dtype="float32"))
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
    # The gradient reduction (on CPU an all-reduce plus a slice stands in for reduce-scatter).
    assert _array_bytes([c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]) == _param_bytes(program)


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

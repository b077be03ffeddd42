"""hierarchical-grads: data-parallel gradients reduced inside the node first. The step's gradients
equal one device's (several meshes, odd shapes, micro-batches, recomputation, segment attention
under a further row split), only a node's share of the gradient bytes crosses the network, each
layer's share inside the backward loop, and the pass says why it does not apply where it does not."""
import dataclasses

import jax
import pytest

from xlaopt import step
from xlaopt.analysis.hlo import collectives
from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.context import PassContext
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.pipeline import pipeline, run_pipeline, select_passes
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.runtime.verify import reference_program
from xlaopt.transforms.hierarchical_grads import HierarchicalGradsTransform

from conftest import COSMOS3_TINY, LLAMA_TINY, SMALL, check_pass, needs_devices

TOPOLOGY = parse_topology("h100:2x4")
FP32 = ExecutionConfig(compute_dtype="float32")
# Nothing in the embedding (1001 x 198) or the norms (198) divides by a node's 4 data ranks:
# those go whole, the rest scattered.
ODD_LLAMA = get_config("llama-tiny", {**SMALL, "d_model": 198, "vocab_size": 1001, "num_heads": 6, "num_kv_heads": 3,
                                      "head_dim": 36})


def _laid_out(program: TrainProgram, topology=TOPOLOGY):
    laid, records = run_pipeline(program, pipeline(), ctx=PassContext.for_program(program, topology))
    return laid, {r.name: r for r in records}


@pytest.fixture(scope="module")
def pure_dp():
    """llama-tiny, data=8 over two nodes of 4, compiled once."""
    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("data=8"), settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                           execution=FP32)
    laid, records = _laid_out(program)
    return program, laid, records, compile_program(laid)


@needs_devices(8)
def test_pure_data_parallel_gradients_equal_one_device(pure_dp):
    program, laid, records, _ = pure_dp
    assert records["hierarchical-grads"].changed
    assert any(isinstance(t, HierarchicalGradsTransform) for t in laid.grad_transforms)
    _, single_records = run_pipeline(reference_program(program), pipeline())
    assert "skipped" in {r.name: r.report for r in single_records}["hierarchical-grads"]
    check_pass(program, TOPOLOGY)


CASES = {  # name -> (model, mesh, batch, execution)
    "odd-shapes-micro-batches": (ODD_LLAMA, "data=8", BatchShape(16, 24, 0), dataclasses.replace(FP32, micro_batches=2)),
    "cosmos3-tensor-full-remat": (COSMOS3_TINY, "data=4,tensor=2", None, dataclasses.replace(FP32, remat="full")),
    # fsdp splits the parameters inside the node and, with segment attention, the rows a second time.
    "cosmos3-fsdp-segment": (COSMOS3_TINY, "data=4,fsdp=2", None,
                             dataclasses.replace(FP32, attention="segment", attention_block=48, remat="dots")),
}


@needs_devices(8)
@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_one_device(case):
    config, mesh, batch, execution = CASES[case]
    settings = TrainSettings(batch=batch) if batch else TrainSettings()
    program = TrainProgram(config, MeshSpec.parse(mesh), settings=settings, execution=execution)
    laid, records = check_pass(program, TOPOLOGY)
    assert records["hierarchical-grads"].changed, records["hierarchical-grads"].report
    if case == "odd-shapes-micro-batches":
        assert set(records["hierarchical-grads"].report["reduced_whole"]) == {
            "embed_ED", "lm_head_DE", "final_norm/scale", "layers/block/attn_norm/scale", "layers/block/mlp_norm/scale"}


@needs_devices(8)
def test_only_a_node_share_of_the_gradients_crosses_the_network_each_layer_inside_the_loop(pure_dp):
    """Without the pass every gradient byte crosses (tests/test_grad_sync.py); with it, a quarter
    (4 data ranks a node), and each layer's in the backward loop: the cross-node all-reduce of a
    layer's shards runs once per layer."""
    program, laid, records, compiled = pure_dp
    network = TOPOLOGY.levels[-1].name
    found = collectives(compiled.train_step.as_text(), laid.mesh.as_dict(), TOPOLOGY.placed(laid.mesh.placement()))
    params, _ = step.abstract_params_with_axes(laid)
    grad_bytes = sum(4 * a.size for a in jax.tree.leaves(params))
    crossing = [c for c in found if c.link_level == network and c.bytes > c.scalar_bytes]
    assert {c.kind for c in crossing} == {"all-reduce"}
    assert sum((c.bytes - c.scalar_bytes) * c.executions for c in crossing) == grad_bytes // 4
    assert records["hierarchical-grads"].report["network_bytes"] == grad_bytes // 4
    layer_bytes = sum(4 * a.size for a in jax.tree.leaves(params["layers"])) // LLAMA_TINY.num_layers
    in_loop = [c for c in crossing if c.executions == LLAMA_TINY.num_layers]
    assert sum(c.bytes - c.scalar_bytes for c in in_loop) == layer_bytes // 4
    inside = [c for c in found if c.link_level != network and c.mesh_axes == ("data",) and c.bytes > c.scalar_bytes]
    assert {c.kind for c in inside} == {"reduce-scatter", "all-gather"}


@needs_devices(8)
def test_the_pass_says_why_it_does_not_apply():
    def reason(mesh, topology=TOPOLOGY):
        program = TrainProgram(LLAMA_TINY, MeshSpec.parse(mesh), settings=TrainSettings(batch=BatchShape(8, 32, 0)))
        return _laid_out(program, topology)[1]["hierarchical-grads"].report.get("skipped")

    # HSDP: fsdp fills the node, XLA already sends only the shards across.
    assert "each node holds one data rank" in reason("data=2,fsdp=4")
    assert "stays inside one node" in reason("data=4", parse_topology("h100:1x8"))
    assert "the nodes are unknown" in reason("data=8", None)
    assert "not split over the data axis" in reason("fsdp=8")
    # Its shard_map manual over data, beside tensor and fsdp, aborts XLA's compile (checked by
    # hand on 16 devices, data=4,fsdp=2,tensor=2 on h100:2x8; tests/test_stack.py's loop aborts).
    assert "XLA aborts the process" in reason("data=2,fsdp=2,tensor=2")
    gpu = TrainProgram(LLAMA_TINY, MeshSpec.parse("data=8"), settings=TrainSettings(batch=BatchShape(8, 32, 0)), target="gpu")
    record = _laid_out(gpu)[1]["hierarchical-grads"]
    assert "NCCL already reduces across nodes in two levels" in record.report["skipped"]
    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("data=2,fsdp=4"), settings=TrainSettings(batch=BatchShape(8, 32, 0)))
    with pytest.raises(UserError, match="hierarchical-grads: each node holds one data rank"):
        run_pipeline(program, select_passes(pipeline(), only=["mesh-layout", "hierarchical-grads"]),
                     ctx=PassContext.for_program(program, TOPOLOGY, requested=["hierarchical-grads"]))


@needs_devices(8)
def test_verify_takes_the_topology_and_the_pass_applies(tmp_path, capsys):
    import json

    from xlaopt.cli import main

    out = tmp_path / "verify.json"
    assert main(["verify", "--model", "llama-tiny", "--mesh", "data=8", "--topology", "h100:2x4", "--batch-size", "8",
                 "--text-len", "32", "--json", str(out)]) == 0
    passes = {p["name"]: p for p in json.loads(out.read_text())["passes"]}
    assert passes["hierarchical-grads"]["changed"] and passes["hierarchical-grads"]["report"]["data_ranks_per_node"] == 4
    assert ": ok" in capsys.readouterr().out
    assert main(["verify", "--model", "llama-tiny", "--mesh", "data=8", "--topology", "h100:1x4"]) == 2
    assert "needs 8 devices; topology h100:1x4 has 4" in capsys.readouterr().err
    assert main(["verify", "--model", "llama-tiny", "--mesh", "data=8", "--topology", "cpu:2x4"]) == 2
    assert "the simulated CPU devices are one host" in capsys.readouterr().err

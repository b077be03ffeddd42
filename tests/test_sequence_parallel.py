"""Sequence parallelism, a choice of the rule table: the residual stream split over the tensor
ranks along the sequence gives the single-device step's numbers, and the compiled step really
runs the residual stream split (gathered before each sub-block, reduced back onto the shards)."""
import pytest
from jax.sharding import PartitionSpec as P

from xlaopt.analysis import gpu_aot
from xlaopt.analysis.hlo import collectives
from xlaopt.build import choose_layout
from xlaopt.compile import compile_program
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.families import family_of
from xlaopt.mesh import MESH_AXES, MeshSpec
from xlaopt.models.layers import RESIDUAL_BLD
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram
from xlaopt.runtime.verify import compare, one_step_grads
from xlaopt.sharding import DEFAULT_RULES, logical_to_spec, sequence_parallel, with_sequence_parallel

from conftest import COSMOS3_TINY, LLAMA_TINY, needs_devices

FP32 = ExecutionConfig(compute_dtype="float32")
SP = with_sequence_parallel(DEFAULT_RULES)


def test_the_rule_splits_the_residual_stream_like_seq_then_over_tensor():
    mesh = MeshSpec.parse("context=2,tensor=2")
    assert dict(SP)["residual_seq"] == ("context", "tensor")
    assert logical_to_spec(RESIDUAL_BLD, (4, 8, 16), SP, mesh, "x") == P(None, ("context", "tensor"))
    assert logical_to_spec(RESIDUAL_BLD, (4, 8, 16), DEFAULT_RULES, mesh, "x") == P(None, "context")
    assert with_sequence_parallel(SP, on=False) == DEFAULT_RULES
    # A table written before the residual stream had its own axis: it follows seq.
    older = tuple(rule for rule in DEFAULT_RULES if rule[0] != "residual_seq")
    assert logical_to_spec(RESIDUAL_BLD, (4, 8, 16), older, mesh, "x") == P(None, "context")
    assert dict(with_sequence_parallel(older))["residual_seq"] == ("context", "tensor")
    assert sequence_parallel(SP, mesh) and not sequence_parallel(DEFAULT_RULES, mesh)
    assert not sequence_parallel(SP, MeshSpec.parse("data=2"))  # no tensor ranks to split over


def test_asking_for_it_without_tensor_ranks_says_so():
    with pytest.raises(UserError, match="mesh data=2 has none; add tensor=N"):
        choose_layout("data=2", None, "llama-tiny", sequence_parallel=True)


def _laid_out(config, mesh: str, rules):
    program, _ = run_pipeline(TrainProgram(config, MeshSpec.parse(mesh), rules=rules, execution=FP32), pipeline())
    return program


def _tensor_gathers(program) -> list:
    text = compile_program(program).grads.as_text()
    return [c for c in collectives(text, program.mesh.as_dict()) if c.kind == "all-gather" and c.mesh_axes == ("tensor",)]


@needs_devices(4)
@pytest.mark.parametrize("config", [LLAMA_TINY, COSMOS3_TINY], ids=["decoder", "cosmos3"])
def test_sequence_parallel_step_matches_single_device(config):
    """On data=2,tensor=2 the step's loss and gradients equal one device's, as `verify` checks;
    and the step gathers the residual stream's sequence over the tensor ranks, where without
    sequence parallelism it gathers nothing over them (the stream is whole on every rank)."""
    program = _laid_out(config, "data=2,tensor=2", SP)
    result = compare(one_step_grads(program), one_step_grads(_laid_out(config, "", DEFAULT_RULES)), "float32")
    assert result["ok"], result
    d = config.d_model
    gathered = {dims for c in _tensor_gathers(program) for _, dims in c.shapes if dims and dims[-1] == d}
    rows = program.settings.batch.batch_size // 2
    batch = program.settings.batch
    lengths = {batch.text_len, batch.gen_len} if family_of(config).generates_video else {batch.text_len}
    assert {(rows, n, d) for n in lengths} <= gathered, gathered
    assert _tensor_gathers(_laid_out(config, "data=2,tensor=2", DEFAULT_RULES)) == []


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_on_the_gpu_target_each_sub_block_reduce_scatters_instead_of_all_reducing():
    """XLA's GPU pipeline turns the partitioner's all-reduce-then-slice into reduce-scatters
    (its CPU pipeline keeps the all-reduce): per layer forward, the attention's and the MLP's
    outputs reduce-scatter onto the sequence shards, and no activation is all-reduced. With fp8
    matmuls the same: the input gradients of q, k, v and of gate, up are reduced as one sum before
    fp8's scale (before it, each sub-block's was all-reduced whole in the backward)."""
    from xlaopt.analysis.topology import parse_topology

    topology = parse_topology("h100:1x2")
    kinds = {}
    for name, rules, matmuls in (("off", DEFAULT_RULES, "compute"), ("on", SP, "compute"), ("fp8", SP, "fp8")):
        program = TrainProgram(LLAMA_TINY, MeshSpec.parse("tensor=2"), rules=rules, target="gpu",
                               execution=ExecutionConfig(attention="cudnn", matmuls=matmuls))
        program, _ = run_pipeline(program, pipeline())
        devices = gpu_aot.gpu_mesh(topology, program.mesh.sizes, MESH_AXES)
        text = compile_program(program, devices).train_step.as_text()
        d, length = LLAMA_TINY.d_model, program.settings.batch.text_len
        rows = program.settings.batch.batch_size
        kinds[name] = {(c.kind, dims) for c in collectives(text, program.mesh.as_dict()) for _, dims in c.shapes
                       if dims[-1:] == (d,) and len(dims) == 3}
    assert ("all-reduce", (rows, length, d)) in kinds["off"]
    assert ("reduce-scatter", (rows, length // 2, d)) in kinds["on"]
    assert not any(kind == "all-reduce" for kind, _ in kinds["on"])
    assert kinds["fp8"] == kinds["on"]


def test_the_planner_offers_it_with_tensor_parallelism_and_prices_what_it_splits():
    """Each tensor-parallel layout comes with and without it; rows whose tokens do not split over
    the tensor ranks are refused with the reason. Priced against the same layout without it: the
    norms and residual adds on 1/tp of the tokens (less compute), 1/tp of the layer input kept
    for backward; the program compiled for it carries the rule."""
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.models.registry import get_config
    from xlaopt.planning.planner import candidate_program
    from xlaopt.planning.price import price
    from xlaopt.planning.shapes import analytic_shape
    from xlaopt.planning.space import Candidate, enumerate_space

    config = get_config("llama3-8b")
    ok, rejected = enumerate_space(config, BatchShape(16, 4098, 0), 16, 8, "cudnn", ("bfloat16",))
    assert {c.sequence_parallel for c in ok if c.tp == 2} == {False, True}
    assert not any(c.sequence_parallel for c in ok if c.tp == 1)
    assert any(r.candidate.sequence_parallel and r.candidate.tp == 4 and r.reason ==
               "sequence parallel: context x tensor = 4 does not divide the row's 4098 tokens" for r in rejected)
    shape, batch, h100 = analytic_shape(config), BatchShape(64, 8192, 0), parse_topology("h100:2x8")
    off, on = (price(Candidate(1, 2, 8, 1, "full", 4, sequence_parallel=sp), shape, batch, h100, "gpu", False)
               for sp in (False, True))
    assert on.breakdown.compute_s < off.breakdown.compute_s
    assert on.memory_parts["saved"] == pytest.approx(off.memory_parts["saved"] / 8)
    program = candidate_program(TrainProgram(config), Candidate(1, 2, 8, 1, sequence_parallel=True))
    assert sequence_parallel(program.rules, program.mesh) and program.mesh.sizes == MeshSpec.of(fsdp=2, tensor=8).sizes

"""Exact PartitionSpecs from the rule table, and clear errors for meshes that do not fit."""
import pytest
from jax.sharding import PartitionSpec as P

from xlaopt.context import PassContext
from xlaopt.mesh import MeshError, MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.passes.mesh_layout import MeshLayout
from xlaopt.program import TrainProgram
from xlaopt.sharding import DEFAULT_RULES, RuleUse, logical_to_spec

from conftest import needs_devices


def test_mesh_spec_parsing():
    m = MeshSpec.parse("data=2,fsdp=2,tensor=2")
    assert m.as_dict() == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2, "context": 1} and m.num_devices == 8
    assert str(MeshSpec.parse("")) == "single-device"
    for bad, msg in [("foo=2", "unknown axis 'foo'"), ("data=0", "positive integer"), ("data", "axis=size"),
                     ("data=2,data=2", "given twice")]:
        with pytest.raises(MeshError, match=msg):
            MeshSpec.parse(bad)


def test_first_matching_rule_wins_and_axes_are_not_reused():
    mesh = MeshSpec.parse("data=2,fsdp=2,tensor=2")
    rules = (("batch", ("data", "fsdp")), ("batch", ("data",)), ("embed", ("fsdp",)), ("embed", ("tensor",)))
    # batch takes data and fsdp, so embed falls through to its second rule.
    assert logical_to_spec(("batch", "embed"), (8, 4), rules, mesh, "x") == P(("data", "fsdp"), "tensor")
    # embed takes fsdp first; a rule needing a taken axis is skipped whole, so batch gets data.
    assert logical_to_spec(("embed", "batch"), (4, 8), rules, mesh, "x") == P("fsdp", "data")


def test_size_one_axes_are_dropped():
    mesh = MeshSpec.parse("fsdp=8")
    assert logical_to_spec(("batch", "seq", "act_embed"), (8, 4, 4), DEFAULT_RULES, mesh, "x") == P("fsdp")


def test_unused_rules_are_reported():
    use = RuleUse()
    rules = DEFAULT_RULES + (("experts", ("tensor",)),)
    logical_to_spec(("batch",), (8,), rules, MeshSpec.parse("data=8"), "x", use)
    assert "experts -> tensor" in use.unused(rules)


def test_layout_specs_on_mesh_data2_fsdp2_tensor2(tiny_config):
    program = TrainProgram(tiny_config, MeshSpec.parse("data=2,fsdp=2,tensor=2"))
    result = MeshLayout().run(program, PassContext())
    params = result.program.shardings.state.params
    assert params["embed_ED"] == P("tensor", "fsdp")
    assert params["lm_head_DE"] == P("fsdp", "tensor")
    layer = params["layers"]["generator"]
    assert layer["q_proj_DHK"] == P(None, "fsdp", "tensor")
    assert layer["o_proj_HKD"] == P(None, "tensor", None, "fsdp")
    assert layer["mlp"]["down_FD"] == P(None, "tensor", "fsdp")
    assert layer["q_norm"]["scale"] == P()
    assert result.program.shardings.batch["gen_x0_BVC"] == P(("data", "fsdp"))
    assert result.program.shardings.batch["text_positions_3BT"] == P(None, ("data", "fsdp"))
    # Adam moments follow their parameters; the step counter is replicated.
    adam = result.program.shardings.state.opt_state[1][0]
    assert adam.mu["embed_ED"] == P("tensor", "fsdp") and adam.count == P()
    assert result.report["unused_rules"] == []


@pytest.mark.parametrize("mesh, message", [
    ("tensor=8", r"tensor=8 does not divide dimension 2 \(kv_heads, size 4\)"),
    ("data=16", r"does not divide dimension 0 \(batch, size 8\) of batch array"),
    ("context=5", r"context=5 does not divide dimension 1 \(seq"),
])
def test_meshes_that_do_not_divide_are_rejected(tiny_config, mesh, message):
    with pytest.raises(MeshError, match=message):
        MeshLayout().run(TrainProgram(tiny_config, MeshSpec.parse(mesh)), PassContext())


def test_hsdp_moves_the_embedding_gradient_to_the_tables_split_without_replicating_it():
    """Under HSDP (data x fsdp) the rows of the embedding's gradient must reach the table's FSDP
    split of the model dimension. Left to XLA's partitioner, a batch over data x fsdp going to
    embed over fsdp was "Involuntary full rematerialization" (the whole activation gathered on every
    device, each micro-batch; issue 28, planning llama3-8b on 8 H100). The lookup's backward writes
    the move (`layers.embedding_lookup`): embed takes fsdp, the rows fall back to data, an
    all-to-all. The sharded gradients equal one device's (`verify` covers the whole step)."""
    from xlaopt.compile import compile_program

    hsdp = MeshSpec.parse("data=2,fsdp=4")
    assert logical_to_spec(("embed", "batch", "residual_seq"), (64, 8, 16), DEFAULT_RULES, hsdp, "x") == P("fsdp", "data")
    compiled = compile_program(TrainProgram(get_config("llama-tiny", {"num_layers": 1}), hsdp))
    compiled.grads  # noqa: B018
    assert not [n for n in compiled.compiler_notes if "replicating" in n], compiled.compiler_notes


def test_over_data_splits_a_dimension_of_its_own_first_then_the_first_data_divides():
    from xlaopt.sharding import over_data

    mesh = MeshSpec.parse("data=2,fsdp=2,tensor=2")
    assert over_data(P(None, "fsdp"), (3, 8), mesh) == P(None, ("fsdp", "data"))  # 3 rows do not split in two
    assert over_data(P("tensor"), (8, 6), mesh) == P("tensor", "data")  # the second dimension is nobody's
    assert over_data(P("tensor"), (8, 3), mesh) == P(("tensor", "data"))
    assert over_data(P(), (), mesh) == P()  # AdamW's count stays whole
    assert over_data(P("data"), (8,), mesh) == P("data")  # already split over data
    assert over_data(P(None), (8,), MeshSpec.parse("fsdp=8")) == P(None)  # no data replicas


@needs_devices(8)
def test_zero1_splits_the_moments_over_data_and_trains_as_replicated_moments_do():
    """ZeRO-1 (`--exec sharded_optimizer=true`): AdamW's moments split over the data replicas,
    the weights not; two steps land on the same weights as with whole moments (fp32; the
    reductions' order may differ). Data is the innermost split of the moments' dimension, so each
    replica's share lies inside the block of the weight it holds: the gradients reach the moments'
    split without a collective-permute (data outermost, calibration row R12 sent 8 of a stage's
    fp32 gradient stacks across stages and replicas, 0.44 s exposed)."""
    import jax
    import numpy as np

    from xlaopt.compile import compile_program
    from xlaopt.execution import ExecutionConfig
    from xlaopt.families import family_of
    from xlaopt.pipeline import pipeline, run_pipeline

    config = get_config("llama-tiny", {"num_layers": 1})
    results = []
    for zero1 in (False, True):
        execution = ExecutionConfig(compute_dtype="float32", sharded_optimizer=zero1)
        program, _ = run_pipeline(TrainProgram(config, MeshSpec.parse("data=4,fsdp=2"), execution=execution),
                                  pipeline())
        compiled = compile_program(program)
        state = compiled.init(jax.random.key(0))
        batch = family_of(config).synthetic(config, program.settings.batch, 0)
        for step in range(2):
            state, _ = compiled.train_step(state, compiled.put_batch(batch.batch(step)), jax.random.key(1))
        specs = [s.spec for s in jax.tree.leaves(compiled.state_shardings.opt_state)]
        held = compiled.train_step.memory_analysis().argument_size_in_bytes  # a device's state and batch
        results.append((jax.tree.map(np.asarray, state.params), specs, held))
        assert "collective-permute" not in compiled.train_step.as_text()
    (whole, whole_specs, whole_bytes), (split, split_specs, split_bytes) = results
    assert split_bytes < whole_bytes
    assert not any("data" in str(s) for s in whole_specs)
    assert sum("data" in str(s) for s in split_specs) >= 2 * len(jax.tree.leaves(whole)) - 2  # mu and nu
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), whole, split)


@needs_devices(8)
def test_zero1_gradients_are_reduce_scattered_after_the_manual_micro_batch_loop():
    """ZeRO-1 with the micro-batch loop manual over data (llama-tiny, data=4,tensor=2, 2
    micro-batches): each weight's gradient that `data_scatter_specs` gives a split of its own is
    reduce-scattered over data after the loop, each replica keeping the share its moments update,
    in place of the all-reduce the step runs with whole moments (Megatron's distributed optimizer:
    half the bytes on the wire); the step equals one device's."""
    import collections
    import math

    import jax

    from xlaopt.analysis.hlo import collectives
    from xlaopt.compile import compile_program
    from xlaopt.execution import ExecutionConfig
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.sharding import data_scatter_specs, entry_axes
    from xlaopt.step import abstract_state

    from conftest import check_pass

    counts = {}
    for zero1 in (False, True):
        execution = ExecutionConfig(compute_dtype="float32", micro_batches=2, sharded_optimizer=zero1)
        program = TrainProgram(get_config("llama-tiny"), MeshSpec.parse("data=4,tensor=2"), execution=execution)
        laid, _ = check_pass(program) if zero1 else run_pipeline(program, pipeline())
        found = collectives(compile_program(laid).train_step.as_text(), laid.mesh.as_dict())
        counts[zero1] = collections.Counter()
        for c in found:
            if c.mesh_axes == ("data",):
                counts[zero1][c.kind] += c.bytes
                counts[zero1]["scalars"] += c.scalar_bytes if c.kind == "all-reduce" else 0
    specs = laid.shardings.state.params
    weights = abstract_state(laid).params
    is_spec = lambda x: x is None or isinstance(x, P)  # noqa: E731
    shares = jax.tree.leaves(data_scatter_specs(specs, weights, laid.mesh), is_leaf=is_spec)
    held = [math.prod(n // math.prod(laid.mesh.size(a) for a in entry_axes(e)) for n, e in
                      zip(w.shape, tuple(spec) + (None,) * (w.ndim - len(spec))))
            for w, spec in zip(jax.tree.leaves(weights), jax.tree.leaves(specs, is_leaf=is_spec))]
    split = 4 * sum(n for n, share in zip(held, shares) if share is not None)
    # Each split weight's whole gradient, as its device holds it (over tensor too), crosses data as a
    # reduce-scatter (gathered over tensor first, it would be twice the bytes), and no longer as an all-reduce.
    assert split > 0 and counts[False]["reduce-scatter"] == 0 and counts[True]["reduce-scatter"] == split, counts
    assert counts[False]["all-reduce"] - counts[False]["scalars"] == split  # with whole moments, all-reduced
    assert counts[True]["all-reduce"] == counts[True]["scalars"], counts  # the loss, the metrics, the clip's norm

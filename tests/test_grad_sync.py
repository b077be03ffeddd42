"""Gradient synchronisation as XLA's partitioner emits it, the baseline the overlap passes build
on (issue 16): under the scanned layer stack each layer's gradients are all-reduced inside the
backward loop as soon as that layer's backward is done (one bucket per layer, not one reduction
at the end); the parameters outside the stack are reduced once after it."""
import jax

from xlaopt import step
from xlaopt.analysis.hlo import collectives
from xlaopt.compile import compile_program
from xlaopt.data.batch import BatchShape
from xlaopt.mesh import MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings

from conftest import needs_devices


@needs_devices(8)
def test_data_parallel_gradients_are_reduced_per_layer_inside_the_backward_loop():
    config = get_config("llama-tiny")
    program = TrainProgram(config, MeshSpec.parse("data=8"), settings=TrainSettings(batch=BatchShape(8, 32, 0)))
    program, _ = run_pipeline(program, pipeline())
    found = collectives(compile_program(program).train_step.as_text(), program.mesh.as_dict())
    reductions = [c for c in found if c.kind == "all-reduce" and c.mesh_axes == ("data",) and c.bytes > c.scalar_bytes]
    params, _ = step.abstract_params_with_axes(program)
    layer_bytes = sum(4 * a.size for a in jax.tree.leaves(params["layers"])) // config.num_layers
    rest_bytes = sum(4 * a.size for a in jax.tree.leaves(params)) - layer_bytes * config.num_layers
    per_layer = [c for c in reductions if c.executions == config.num_layers]
    assert [c.bytes for c in per_layer] == [layer_bytes]  # one fp32 bucket of one layer's gradients, every layer
    once = [c for c in reductions if c.executions == 1]
    # Embeddings, head and final norm after the loop (with the loss terms' scalars beside them).
    assert sum(c.bytes - c.scalar_bytes for c in once) == rest_bytes


@needs_devices(8)
def test_hsdp_keeps_all_but_a_node_share_of_the_gradient_bytes_off_the_network():
    """2 nodes of 4 (h100:2x4): pure data parallel all-reduces every gradient byte across the
    nodes; HSDP (fsdp=4 inside a node, data=2 across) reduces the gradients inside the node and
    only their shards across: 1/devices_per_node of the weights' gradient bytes on the network
    (the norm scales, replicated, cross whole: 0.05% here). That includes the embedding table,
    whose gradient goes straight to its own sharding (`models/layers.py`); transposing the
    lookup's constraint made it one all-reduce over every device."""
    from xlaopt.analysis.topology import parse_topology

    topology, config = parse_topology("h100:2x4"), get_config("llama-tiny")
    network = topology.levels[-1].name
    shares = {}
    for mesh in ("data=8", "data=2,fsdp=4"):
        program = TrainProgram(config, MeshSpec.parse(mesh), settings=TrainSettings(batch=BatchShape(8, 32, 0)))
        program, _ = run_pipeline(program, pipeline())
        found = collectives(compile_program(program).train_step.as_text(), program.mesh.as_dict(),
                            topology.placed(program.mesh.placement()))
        params, _ = step.abstract_params_with_axes(program)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        is_scale = lambda path: "scale" in jax.tree_util.keystr(path)  # noqa: E731
        weights = sum(4 * a.size for path, a in leaves if not is_scale(path))
        scales = sum(4 * a.size for path, a in leaves if is_scale(path))
        on_network = sum((c.bytes - c.scalar_bytes) * c.executions for c in found
                         if c.kind in ("all-reduce", "reduce-scatter") and c.link_level == network)
        shares[mesh] = (on_network - scales) / weights
    assert shares["data=8"] == 1.0
    assert shares["data=2,fsdp=4"] == 1 / topology.devices_per_node

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

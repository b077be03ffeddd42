"""collective-matmul: tensor parallel's output projections as a ring of ppermutes beside partial
matmuls. The ring equals the einsum, forward and backward, both ways round; the step's gradients
equal one device's (alone, with hierarchical-grads, unidirectional); the compiled layer loop
interleaves each ppermute step with a partial matmul; and, on the GPU target, XLA's schedule
puts compute between each collective-permute's start and done."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from xlaopt.analysis.hlo import compute_inside_async, parse
from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.context import PassContext
from xlaopt.data.batch import BatchShape
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.pipeline import pipeline, run_pipeline, select_passes
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.transforms.collective_matmul import CollectiveMatmulTransform

from conftest import COSMOS3_TINY, LLAMA_TINY, check_pass, needs_devices

FP32 = ExecutionConfig(compute_dtype="float32")


@needs_devices(8)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_ring_equals_the_einsum_forward_and_backward(bidirectional):
    # In float64: the ring reorders every sum (the weight gradient's 64 products of terms up to ~10
    # cancel to values near 0.01), which in float32 moved results by 1.3e-5 on one CPU and not on
    # another. In float64 the same math must agree to 1e-10, whatever the CPU.
    with jax.enable_x64(True):
        mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
        ring = CollectiveMatmulTransform("tensor", 4, bidirectional)
        x = jax.random.normal(jax.random.key(0), (4, 16, 8, 5), jnp.float64)
        w = jax.random.normal(jax.random.key(1), (8, 5, 12), jnp.float64)
        eq = "blhk,hkd->bld"
        loss = lambda mm, x, w: jnp.sum(jnp.sin(mm(eq, x, w)))  # noqa: E731
        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(functools.partial(loss, lambda e, x, w: ring.matmul(e, x, w, 2, 0)),
                                             argnums=(0, 1)))(x, w)
        want = jax.value_and_grad(functools.partial(loss, lambda e, x, w: jnp.einsum(e, x, w)), argnums=(0, 1))(x, w)
        assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(got))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


ON = {"collective-matmul": {"enabled": True}}


def _laid_out(program, topology=None, **options):
    options = {name: dict(ON.get(name, {}), **options.get(name, {})) for name in {*ON, *options}}
    laid, records = run_pipeline(program, pipeline(options), ctx=PassContext.for_program(program, topology))
    return laid, {r.name: r for r in records}


CASES = {  # name -> (model, mesh, batch, pass options, topology, the passes that must apply)
    "llama-unidirectional": (LLAMA_TINY, "data=2,tensor=4", BatchShape(8, 32, 0),
                             {"collective-matmul": {"bidirectional": False}}, None, {"collective-matmul"}),
    "cosmos3-fsdp": (COSMOS3_TINY, "fsdp=4,tensor=2", None, {}, None, {"collective-matmul"}),
    "cosmos3-with-hierarchical-grads": (COSMOS3_TINY, "data=4,tensor=2", None, {},
                                        parse_topology("h100:2x4"), {"collective-matmul", "hierarchical-grads"}),
}


@needs_devices(8)
@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_one_device(case):
    config, mesh, batch, options, topology, applied = CASES[case]
    settings = TrainSettings(batch=batch) if batch else TrainSettings()
    program = TrainProgram(config, MeshSpec.parse(mesh), settings=settings, execution=FP32)
    options = {name: dict(ON.get(name, {}), **options.get(name, {})) for name in {*ON, *options}}
    # Equal to one device, and a second run (every applicable pass applying again) changes nothing.
    laid, records = check_pass(program, topology, options)
    assert {name for name, r in records.items() if r.changed} >= applied | {"mesh-layout"}


def _dot_ops(comps) -> set[str]:
    """Names of the instructions that run a matmul: dots, and fusions or calls whose body holds one."""
    with_dot = {name for name, ins in comps.items() if any(i.opcode == "dot" for i in ins)}
    called = lambda i: {c.strip().lstrip("%") for part in i.attrs.split(",") if "calls=" in part  # noqa: E731
                        for c in [part.split("calls=")[1]]}
    return {i.name for ins in comps.values() for i in ins
            if i.opcode == "dot" or (i.opcode in ("fusion", "call") and called(i) & with_dot)}


@needs_devices(8)
def test_each_ppermute_step_meets_a_partial_matmul_in_the_layer_loop():
    """Forward layer loop body: two ring matmuls a layer (attention output, MLP down), three steps
    of a ring of four, one ppermute each way a step: 12 collective-permutes, each received running
    sum added to a partial matmul that does not depend on it (what a GPU schedule overlaps with the
    transfer, below; XLA's CPU scheduler runs the matmuls first). Without the pass: none."""
    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("data=2,tensor=4"), settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                           execution=FP32)
    bare, _ = run_pipeline(program, select_passes(pipeline(), ["mesh-layout"]))
    comps, _ = parse(compile_program(bare).train_step.as_text())
    assert not any(i.opcode == "collective-permute" for ins in comps.values() for i in ins)

    laid, _ = run_pipeline(program, select_passes(pipeline(ON), ["mesh-layout", "collective-matmul"]))
    comps, _ = parse(compile_program(laid).train_step.as_text())
    dots = _dot_ops(comps)
    forward = [ins for ins in comps.values() if any(i.opcode == "collective-permute" and
                                                    any(i.name in u.operands and set(u.operands) & dots for u in ins)
                                                    for i in ins)]
    assert len(forward) == 1, "one forward loop body whose ppermutes meet matmuls"
    (body,) = forward
    permutes = [i for i in body if i.opcode == "collective-permute"]
    assert len(permutes) == 12
    for p in permutes:
        users = [u for u in body if p.name in u.operands]
        assert any(set(u.operands) & dots for u in users), f"{p.name} is not added to a partial matmul"


@needs_devices(8)
def test_the_pass_says_why_it_does_not_apply():
    def reason(mesh, **execution):
        program = TrainProgram(LLAMA_TINY, MeshSpec.parse(mesh), settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                               execution=dataclasses.replace(FP32, **execution))
        return _laid_out(program)[1]["collective-matmul"].report.get("skipped")

    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("tensor=4"), settings=TrainSettings(batch=BatchShape(8, 32, 0)))
    assert "off unless enabled" in {r.name: r for r in run_pipeline(program, pipeline())[1]}[
        "collective-matmul"].report["skipped"]
    assert "no tensor parallelism" in reason("data=8")
    assert "context parallel" in reason("context=2,tensor=4", attention="segment")
    assert "1F1B runs each stage's layers under a conditional" in reason(
        "stage=2,tensor=4", layer_stack="pipeline", pipeline_schedule="1f1b")


def test_on_the_gpu_target_xla_schedules_compute_inside_the_ring_transfers(tmp_path):
    """llama3-8b's shapes (two layers), tensor=4, rows of 8,192: the ring's collective-permutes
    are async in XLA's GPU schedule and nearly all hold compute between start and done (49 of 52
    on jax 0.10.2; the rest sit where the schedule has nothing independent left)."""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis.analyze import analyze

    topology = parse_topology("h100:1x8")
    program = TrainProgram(get_config("llama3-8b", {"num_layers": 2}), MeshSpec.parse("fsdp=2,tensor=4"),
                           settings=TrainSettings(batch=BatchShape(8, 8192, 0)), target="gpu",
                           execution=ExecutionConfig(attention="cudnn", remat="full"))
    windows = {}
    for label, passes in (("before", ["mesh-layout", "overlap-flags"]),
                          ("after", ["mesh-layout", "collective-matmul", "overlap-flags"])):
        laid, _ = run_pipeline(program, select_passes(pipeline(ON), passes), ctx=PassContext.for_program(program, topology))
        analyze(laid, topology, dump_dir=str(tmp_path / label))
        windows[label] = compute_inside_async((tmp_path / label / "analyzed-gpu.compiled.hlo").read_text(),
                                              "collective-permute")
    ring = len(windows["after"]) - len(windows["before"])
    assert ring >= 2 * 2 * 3, windows  # at least one layer's forward: two rings, three steps, both ways
    overlapped = sum(w >= 1 for w in windows["after"])
    assert overlapped >= 0.9 * len(windows["after"]), windows["after"]

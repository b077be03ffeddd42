"""fp8 matmuls with per-tensor current scaling (`xlaopt.models.fp8`): the recipe's numbers, the
sharded step against one device within fp8's tolerance, the GPU target's fp8 GEMMs, and where
fp8 is refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.analysis import gpu_aot
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MESH_AXES, MeshSpec
from xlaopt.models.fp8 import BACKWARD, FORWARD, fp8_einsum, fp8_einsums, quantize
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram
from xlaopt.runtime.verify import TOLERANCES, compare, one_step_grads, reference_program, tolerance_key

from conftest import LLAMA_TINY, needs_devices

FP8 = ExecutionConfig(compute_dtype="float32", matmuls="fp8")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_current_scaling_puts_the_maximum_on_the_formats_largest_value():
    x = jnp.array([[0.5, -3.0], [1.25, 0.0]], jnp.bfloat16)
    q, scale = quantize(x, FORWARD)
    assert q.dtype == FORWARD and float(scale) == pytest.approx(3.0 / 448)
    assert float(q[0, 1]) == -448.0 and float(q[1, 1]) == 0.0
    _, zero_scale = quantize(jnp.zeros((2, 2)), BACKWARD)
    assert float(zero_scale) == 1.0  # nothing to scale: no division by zero


def test_the_projection_and_both_its_gradients_are_within_fp8_rounding_of_the_exact_ones():
    """Forward operands in E4M3 (each element within 2^-4 of itself, half a step of 3 mantissa
    bits), the output gradient in E5M2 (within 2^-3): the product and the gradients stay within
    those relative errors in L2 (measured 0.037 forward, 0.058 for both gradients); a scale
    missing or applied twice would be off by orders of magnitude."""
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (2, 64, 128), jnp.bfloat16)
    w = (jax.random.normal(k[1], (128, 4, 32)) * 0.1).astype(jnp.bfloat16)
    probe = jax.random.normal(k[2], (2, 64, 4, 32))
    eq = "bld,dhk->blhk"
    loss = lambda fn: lambda x, w: jnp.sum(fn(eq, x, w).astype(jnp.float32) * probe)  # noqa: E731
    exact = jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, w)
    fp8 = jax.jit(jax.grad(loss(fp8_einsum), argnums=(0, 1)))(x, w)
    assert _rel(fp8_einsum(eq, x, w), jnp.einsum(eq, x, w)) < 2.0**-4
    assert [g.dtype for g in fp8] == [jnp.bfloat16, jnp.bfloat16]
    assert max(_rel(a, b) for a, b in zip(fp8, exact)) < 2.0**-3
    # The three matmuls read fp8 operands (not dequantized copies): E4M3 x E4M3 forward, E5M2 x
    # E4M3 for each gradient.
    dots = _dots(jax.make_jaxpr(jax.grad(loss(fp8_einsum), argnums=(0, 1)))(x, w).jaxpr)
    assert sorted(tuple(str(v.aval.dtype) for v in e.invars) for e in dots) == [
        ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"), ("float8_e5m2", "float8_e4m3fn")]


def test_projections_of_one_input_share_one_scale_and_stay_within_fp8_rounding():
    """q, k and v (or gate and up) as one fused projection: one weight scale and one output
    gradient scale for the group, as Transformer Engine's fused QKV and fc1. A weight 100x smaller
    than the group's largest stays in E4M3's normal range, so every output and gradient is as
    close to the exact one as a projection of its own (the bounds above); the input gradient is
    one sum of fp8 GEMMs."""
    k = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(k[0], (2, 64, 128), jnp.bfloat16)
    ws = ((jax.random.normal(k[1], (128, 4, 32)) * 0.1).astype(jnp.bfloat16),
          (jax.random.normal(k[2], (128, 2, 32)) * 0.001).astype(jnp.bfloat16))
    eqs = ("bld,dhk->blhk", "bld,dnk->blnk")
    probes = (jax.random.normal(k[3], (2, 64, 4, 32)), jax.random.normal(k[4], (2, 64, 2, 32)) * 100)

    def loss(fn):
        return lambda x, ws: sum(jnp.sum(y.astype(jnp.float32) * p) for y, p in zip(fn(x, ws), probes))

    exact_fn = lambda x, ws: tuple(jnp.einsum(eq, x, w) for eq, w in zip(eqs, ws))  # noqa: E731
    fused_fn = lambda x, ws: fp8_einsums(eqs, x, ws)  # noqa: E731
    for got, want in zip(fused_fn(x, ws), exact_fn(x, ws)):
        assert _rel(got, want) < 2.0**-4
    exact = jax.grad(loss(exact_fn), argnums=(0, 1))(x, ws)
    fused = jax.jit(jax.grad(loss(fused_fn), argnums=(0, 1)))(x, ws)
    assert _rel(fused[0], exact[0]) < 2.0**-3
    assert max(_rel(a, b) for a, b in zip(fused[1], exact[1])) < 2.0**-3
    dots = _dots(jax.make_jaxpr(jax.grad(loss(fused_fn), argnums=(0, 1)))(x, ws).jaxpr)
    assert len(dots) == 6 and all(str(v.aval.dtype).startswith("float8") for e in dots for v in e.invars)


def _dots(jaxpr) -> list:
    """Every dot_general of a jaxpr, in the sub-jaxprs (custom_vjp, pjit) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_dots(inner))
    return found


@needs_devices(4)
def test_sharded_fp8_step_matches_one_device_within_fp8s_tolerance():
    """data=2,tensor=2 against one device, both in fp8, as `verify` compares them (its docstring
    says why one E5M2 step): ok; and the gradients really went through fp8 (they differ from
    the same program's without it by more than float32's tolerance)."""
    program, _ = run_pipeline(TrainProgram(LLAMA_TINY, MeshSpec.parse("data=2,tensor=2"), execution=FP8), pipeline())
    sharded = one_step_grads(program)
    result = compare(sharded, one_step_grads(reference_program(program)), tolerance_key(program.execution))
    assert tolerance_key(program.execution) == "fp8" and result["ok"], result
    unquantized = compare(sharded, one_step_grads(TrainProgram(LLAMA_TINY, execution=ExecutionConfig("float32"))),
                          "float32")
    assert unquantized["max_rel_diff_grads"] > 10 * TOLERANCES["float32"][1]


def test_collective_matmul_leaves_fp8_programs_alone():
    from xlaopt.context import PassContext
    from xlaopt.passes.collective_matmul import CollectiveMatmul
    from xlaopt.passes.mesh_layout import MeshLayout

    program = TrainProgram(LLAMA_TINY, MeshSpec.parse("tensor=2"), execution=FP8)
    laid_out = MeshLayout().run(program, PassContext()).program
    assert "fp8 matmuls" in CollectiveMatmul(enabled=True).why_not(laid_out, PassContext())


def test_a_gpu_without_fp8_refuses_it_before_compiling():
    """(The CLI's refusals, on an A100 and in `train`, are rows of test_bad_inputs.)"""
    from xlaopt.analysis.analyze import analyze
    from xlaopt.analysis.topology import parse_topology

    with pytest.raises(UserError, match="A100.* has no fp8 matmuls"):
        analyze(TrainProgram(LLAMA_TINY, execution=FP8), parse_topology("a100:1x8"), "gpu")


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_on_the_gpu_target_every_projection_is_an_fp8_gemm():
    """XLA's GPU compiler (jax 0.10.2) runs each projection's forward and both backward matmuls
    as GEMMs on fp8 operands: Triton GEMM fusions by default, cuBLASLt's fp8 custom call with
    Triton GEMMs off. A quantize-dequantize pair before a bf16 dot would not do: its
    excess-precision rewrite folds the round trip away and no fp8 reaches the GEMM."""
    from xlaopt.analysis.hlo import fp8_gemms
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.compile import compile_program

    topology = parse_topology("h100:1x1")

    def compiled_text(execution, options=()):
        program = TrainProgram(LLAMA_TINY, execution=execution, target="gpu")
        program, _ = run_pipeline(program, pipeline())
        if options:
            program = program.replace(compiler_options=program.compiler_options.merged(dict(options)))
        return compile_program(program, gpu_aot.gpu_mesh(topology, (1, 1, 1, 1, 1), MESH_AXES)
                               ).train_step.as_text()

    execution = ExecutionConfig(matmuls="fp8", attention="cudnn", layer_stack="unrolled")
    text = compiled_text(execution)
    # Per layer: q, k, v, o, gate, up and down, each forward, input gradient and weight gradient,
    # but XLA merges the matmuls that share an operand (q, k and v read the same normed input;
    # gate and up too): forward qkv, o, gate-up, down; the 7 input gradients; weight gradients
    # qkv, o, gate-up, down. 15 a layer, every one on fp8 operands.
    per_layer = 4 + 7 + 4
    assert fp8_gemms(text) == per_layer * LLAMA_TINY.num_layers and "__cublas$lt$matmul$f8" not in text
    cublas = compiled_text(execution, {"xla_gpu_enable_triton_gemm": False})
    assert cublas.count('custom_call_target="__cublas$lt$matmul$f8"') == per_layer * LLAMA_TINY.num_layers
    assert fp8_gemms(cublas) == per_layer * LLAMA_TINY.num_layers

    # The round trip through fp8 before a bf16 dot never reaches an fp8 GEMM: folded away.
    def dequantized(x):
        q, scale = quantize(x, FORWARD)
        return q.astype(x.dtype) * scale.astype(x.dtype)

    mesh = gpu_aot.gpu_mesh(topology, (1,), ("x",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=whole) for s in ((256, 512), (512, 1024)))
    folded = jax.jit(lambda x, w: dequantized(x) @ dequantized(w)).lower(x, w).compile().as_text()
    assert "f8e" not in folded


def test_the_planner_gains_fp8_where_the_device_has_it_with_its_time_and_memory():
    """llama3-8b on 8 H100: every candidate has an fp8 twin, priced faster (the projections at
    the fp8 peak) with half the weights in flight (the fp8 copy, gathered in fp8); on an A100 the
    dimension is absent, and asking for it there is refused."""
    import dataclasses

    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.data.batch import BatchShape
    from xlaopt.models.registry import get_config
    from xlaopt.planning.planner import plan
    from xlaopt.program import TrainSettings

    program = TrainProgram(get_config("llama3-8b"), settings=TrainSettings(batch=BatchShape(8, 8192, 0)))
    batch = synthetic_batch(program)
    h100 = plan(program, parse_topology("h100:1x8"), batch, top=0, remats=("full", "selective_megatron"))
    every = h100.ranked + h100.unfit
    by_candidate = {p.candidate: p for p in every}
    fp8 = [p for p in every if p.candidate.precision == "fp8"]
    assert {p.candidate.precision for p in every} == {"bfloat16", "float16", "fp8"} and h100.best in fp8
    for p in fp8:
        twin = by_candidate[dataclasses.replace(p.candidate, matmuls="compute")]
        assert twin.candidate.precision == "bfloat16" and p.step_time_s < twin.step_time_s
        assert 2 * p.analytic.memory_parts["weights"] == twin.analytic.memory_parts["weights"]
    a100 = plan(program, parse_topology("a100:1x8"), batch, top=0, remats=("full",))
    assert "fp8" not in {p.candidate.precision for p in a100.ranked + a100.unfit}
    with pytest.raises(UserError, match="A100.* has no fp8 matmuls"):
        plan(program, parse_topology("a100:1x8"), batch, top=0, remats=("full",), precisions=("fp8",))


def test_fp8_layers_save_what_bf16_layers_save_or_less():
    """Traced from the vjp, as the planner does: the layer input under `full` and the dot outputs
    under `dots` (the fp8 GEMM writes the compute dtype) are the same size as in bf16; without
    recomputation the projections keep their inputs in fp8, less than their bf16 inputs."""
    from xlaopt.data.batch import BatchShape
    from xlaopt.planning.residuals import saved_bytes_per_token_layer
    from xlaopt.program import TrainSettings

    program = TrainProgram(LLAMA_TINY, settings=TrainSettings(batch=BatchShape(4, 32, 0)),
                           execution=ExecutionConfig(attention="segment"))
    bf16 = saved_bytes_per_token_layer(program, "bfloat16")
    fp8 = saved_bytes_per_token_layer(program, "bfloat16", "fp8")
    assert fp8["full"] == bf16["full"] == 2 * LLAMA_TINY.d_model and fp8["dots"] == bf16["dots"]
    assert fp8["none"] < bf16["none"]


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_under_fsdp_xla_gathers_the_projection_weights_in_fp8():
    """What the planner's price assumes (`planning/price.py`: fp8 weights gathered at 1 B): on
    the GPU target XLA casts each weight shard to fp8 before FSDP's all-gather (the scale is a
    max over every shard), so the gathers carry f8e4m3fn, not the fp32 master weights."""
    import re

    from xlaopt.analysis.topology import parse_topology
    from xlaopt.compile import compile_program

    topology = parse_topology("h100:1x2")

    def gathered_dtypes(matmuls):
        program = TrainProgram(LLAMA_TINY, MeshSpec.parse("fsdp=2"), target="gpu",
                               execution=ExecutionConfig(matmuls=matmuls, attention="cudnn"))
        program, _ = run_pipeline(program, pipeline())
        mesh = gpu_aot.gpu_mesh(topology, MeshSpec.parse("fsdp=2").sizes, MESH_AXES)
        text = compile_program(program, mesh).train_step.as_text()
        # The results of the (combined) gathers: the shape list before each `all-gather-done(`.
        results = [line.split(" all-gather-done(")[0] for line in text.splitlines() if " all-gather-done(" in line]
        return {dtype for r in results for dtype in re.findall(r"(\w+)\[", r.split("=", 1)[1])}

    fp8, compute = gathered_dtypes("fp8"), gathered_dtypes("compute")
    assert "f8e4m3fn" in fp8 and "f8e4m3fn" not in compute and "f32" in compute  # bf16 gathers fp32 masters

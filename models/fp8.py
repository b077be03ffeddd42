"""fp8 matmuls for the linear projections, with per-tensor current scaling.

Each operand is scaled by its own absolute maximum, taken now (not a history of past steps, as
delayed scaling keeps), so that its largest element lands on the format's largest finite value,
and cast: activations and weights to E4M3 (3 mantissa bits) forward, output gradients to E5M2 (2
mantissa bits, the range gradients need) backward. Every matmul of the projection, the forward
and both of its backward ones, reads fp8 operands, accumulates in fp32 and writes the compute
dtype, rescaled by the product of its operands' scales. This is the recipe Transformer Engine
calls current scaling.

The matmul is written on the fp8 operands themselves, not on dequantized copies: XLA's GPU
compiler (jax 0.10.2) turns a dot of fp8 operands into an fp8 GEMM (a Triton GEMM fusion on fp8
parameters by default, cuBLASLt's `__cublas$lt$matmul$f8` with Triton GEMMs off), while a
quantize-dequantize pair before a bf16 dot is folded away by its excess-precision rewrite
(`xla_allow_excess_precision`, on by default) and never reaches fp8, which the tests check.

Projections of one input (attention's q, k and v; a gated MLP's gate and up) run as one fused
projection (`project_all`), as Transformer Engine fuses them into one QKV and one fc1 weight:
their weights share one scale, and so do their output gradients. E4M3's normal range (2^-6 to
448, near 2^15) keeps a weight's largest element up to 2^14 below the group's at the format's
full relative precision. The input gradient is then one sum, scaled once, which the partitioner
reduces as it reduces the compute dtype's (`fp8_einsums`).

Which matmuls run in fp8 is set for a trace (`matmuls_in`), as Transformer Engine's recipe
context sets it: the attention's q, k, v and output projections and the MLP's; embeddings, the
head and attention's own matmuls stay in the compute dtype, as in Transformer Engine and
MaxText's fp8 recipes.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from xlaopt.models.tracing import installed

FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2
MATMULS = ("compute", "fp8")

_MATMULS: contextvars.ContextVar[str] = contextvars.ContextVar("xlaopt_matmuls", default="compute")


def matmuls_in(matmuls: str):
    """Context manager: the projections traced inside run their matmuls in `matmuls`
    ("compute": the compute dtype; "fp8": this module's recipe)."""
    assert matmuls in MATMULS, matmuls
    return installed(_MATMULS, matmuls)


def project(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(equation, x, w)` for a linear projection, in the matmul format of the trace."""
    return project_all((equation,), x, (w,))[0]


def project_all(equations: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...],
                input_grad: Callable | None = None) -> tuple[jax.Array, ...]:
    """`einsum(equations[i], x, ws[i])` for each i: the projections one input feeds (attention's
    q, k and v; a gated MLP's gate and up), in the matmul format of the trace. In fp8 they are one
    fused projection, as Transformer Engine fuses QKV and fc1 (`fp8_einsums`)."""
    if _MATMULS.get() == "fp8":
        return fp8_einsums(tuple(equations), x, tuple(ws), input_grad)
    return tuple(jnp.einsum(eq, x, w) for eq, w in zip(equations, ws))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x in `dtype`, fp32 scale) with x ~= q * scale and max|x| mapped to the format's largest
    finite value; an all-zero tensor takes scale 1."""
    (q,), scale = quantize_all((x,), dtype)
    return q, scale


def quantize_all(xs: tuple[jax.Array, ...], dtype) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """`quantize` with one scale for all of `xs`: the largest |x| among them on the format's
    largest finite value."""
    top = float(jnp.finfo(dtype).max)
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in xs])
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return tuple(jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype) for x in xs), scale


def _scaled(equation: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    # The GEMM accumulates in fp32 and writes `dtype` (as cuBLASLt's fp8 GEMMs do), so the dot's
    # output, which JAX's `dots` recomputation policy saves, is the compute dtype's size.
    return jnp.einsum(equation, a, b, preferred_element_type=dtype) * scale.astype(dtype)


def _transposes(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.split("->")
    x, w = inputs.split(",")
    # A projection contracts what its operands share and keeps the rest: each operand's gradient
    # is then the einsum of the output gradient with the other operand.
    assert set(x) <= set(w) | set(out) and set(w) <= set(x) | set(out), equation
    return x, w, out


def fp8_einsum(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum(equation, x, w)` in fp8 (module docstring), in the operands' (common) dtype."""
    return fp8_einsums((equation,), x, (w,))[0]


def fp8_einsums(equations: tuple[str, ...], x: jax.Array, ws: tuple[jax.Array, ...],
                input_grad: Callable | None = None) -> tuple[jax.Array, ...]:
    """`einsum(equations[i], x, ws[i])` for each i in fp8, as one fused projection: the weights
    share one scale and the output gradients another (module docstring), so the input gradient is
    one sum of fp8 GEMMs, scaled once. `input_grad`, where given, takes that sum before the scale:
    the caller's constraint putting it where the input came from (`layers.onto_residual_shards`).
    The tensor ranks' partial sums are then reduced straight onto it, a reduce-scatter under
    sequence parallelism. Scaled first, XLA's partitioner all-reduced the whole gradient and
    sliced it after the scale, which XLA's GPU compile does not turn into a reduce-scatter (one
    all-reduce a projection, where the compute dtype's step reduce-scatters;
    `tests/test_sequence_parallel.py`)."""
    assert all(x.dtype == w.dtype for w in ws), (x.dtype, [w.dtype for w in ws])  # gradients return in it
    return _einsums(tuple(equations), input_grad, x, tuple(ws))


def _forward(equations, input_grad, x, ws):
    qx, sx = quantize(x, FORWARD)
    qws, sw = quantize_all(ws, FORWARD)
    outs = tuple(_scaled(eq, qx, qw, sx * sw, x.dtype) for eq, qw in zip(equations, qws))
    return outs, (qx, sx, qws, sw)


def _backward(equations, input_grad, saved, grads):
    qx, sx, qws, sw = saved
    qgs, sg = quantize_all(grads, BACKWARD)
    dx, dws = None, []
    for eq, qw, qg in zip(equations, qws, qgs):
        xs, ws, out = _transposes(eq)
        part = jnp.einsum(f"{out},{ws}->{xs}", qg, qw, preferred_element_type=grads[0].dtype)
        dx = part if dx is None else dx + part
        dws.append(_scaled(f"{xs},{out}->{ws}", qx, qg, sx * sg, grads[0].dtype))
    if input_grad is not None:
        dx = input_grad(dx)
    return dx * (sg * sw).astype(dx.dtype), tuple(dws)


_einsums = jax.custom_vjp(lambda equations, input_grad, x, ws: _forward(equations, input_grad, x, ws)[0],
                          nondiff_argnums=(0, 1))
_einsums.defvjp(_forward, _backward)

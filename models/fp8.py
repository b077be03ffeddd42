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

Which matmuls run in fp8 is set for a trace (`matmuls_in`), as Transformer Engine's recipe
context sets it: the attention's q, k, v and output projections and the MLP's; embeddings, the
head and attention's own matmuls stay in the compute dtype, as in Transformer Engine and
MaxText's fp8 recipes.
"""
from __future__ import annotations

import contextvars

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
    return fp8_einsum(equation, x, w) if _MATMULS.get() == "fp8" else jnp.einsum(equation, x, w)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x in `dtype`, fp32 scale) with x ~= q * scale and max|x| mapped to the format's largest
    finite value; an all-zero tensor takes scale 1."""
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype), scale


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
    assert x.dtype == w.dtype, (x.dtype, w.dtype)  # both gradients are returned in it
    return _einsum(equation, x, w)


def _forward(equation, x, w):
    qx, sx = quantize(x, FORWARD)
    qw, sw = quantize(w, FORWARD)
    return _scaled(equation, qx, qw, sx * sw, x.dtype), (qx, sx, qw, sw)


def _backward(equation, saved, grad):
    qx, sx, qw, sw = saved
    xs, ws, out = _transposes(equation)
    qg, sg = quantize(grad, BACKWARD)
    dx = _scaled(f"{out},{ws}->{xs}", qg, qw, sg * sw, grad.dtype)
    dw = _scaled(f"{xs},{out}->{ws}", qx, qg, sx * sg, grad.dtype)
    return dx, dw


_einsum = jax.custom_vjp(lambda equation, x, w: _forward(equation, x, w)[0], nondiff_argnums=(0,))
_einsum.defvjp(_forward, _backward)

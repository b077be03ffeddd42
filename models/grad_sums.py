"""How a loop that sums the weights' gradients itself (a 1F1B pipeline's ticks, the micro-batch loop
manual over data) sums them over micro-batches and over the mesh, and where it leaves them: what the
step installs while the model is traced, read where the loop is written.

- `gradients_summed_by`: the sum over the manual axes, crossing them in the dtype the step reduces
  gradients in (`micro_batches.summed_in`);
- `gradients_accumulated_in`: the dtype the loop's accumulators hold (`grad_accumulate_dtype`);
- `gradients_scattered_by`: under ZeRO-1, the dimension along which each data replica keeps its
  share of a stacked weight's gradient (`sharding.data_scatter_dims`).
"""
from __future__ import annotations

import contextvars
from typing import Callable

import jax
import jax.numpy as jnp

from xlaopt.mesh import DATA
from xlaopt.models.tracing import installed

# How a loop that sums the weights' gradients over data itself (a 1F1B pipeline's ticks) sums
# them: `sum(g, axes, scatter_dim=None)`, crossing the axes in the dtype the step reduces gradients in
# and returned in it (`micro_batches.summed_in`); `reduced_over` unless a step installs one.
_GRADIENTS_SUMMED: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_gradients_summed",
                                                                                   default=None)


def gradients_summed_by(sum_fn: Callable):
    """Context manager installing how a loop sums the weights' gradients over data itself."""
    return installed(_GRADIENTS_SUMMED, sum_fn)


def reduced_over(g, axes: tuple[str, ...], scatter_dim: int | None = None):
    """`g` summed over the manual `axes`; with `scatter_dim`, each `data` replica's share of the sum
    along that dimension, the one its moments update (ZeRO-1, `gradients_scattered_by`). Summed
    whole and then sliced, not `psum_scatter`ed: in a shard_map that leaves `tensor` to the
    partitioner, XLA gathered each gradient over tensor before reduce-scattering it over data
    (calibration row R13: 4x the bytes of the all-reduce). Megatron's distributed optimizer
    reduce-scatters, half the all-reduce's bytes."""
    summed = jax.lax.psum(g, axes)
    if scatter_dim is None:
        return summed
    share = g.shape[scatter_dim] // jax.lax.axis_size(DATA)
    return jax.lax.dynamic_slice_in_dim(summed, jax.lax.axis_index(DATA) * share, share, scatter_dim)


def summed_gradients(tree, axes: tuple[str, ...], scatter=None):
    """`tree`'s gradients summed over `axes` as the step sums them (`gradients_summed_by`); `scatter`,
    where given, a tree of the dimension each is reduce-scattered onto over data (None: summed)."""
    sum_fn = _GRADIENTS_SUMMED.get() or reduced_over
    if scatter is None:
        return jax.tree.map(lambda g: sum_fn(g, axes), tree)
    return jax.tree.map(lambda dim, g: sum_fn(g, axes, dim), scatter, tree, is_leaf=lambda x: x is None)


# Where a loop that sums the weights' gradients over data itself (a 1F1B pipeline's ticks) leaves
# each over data, installed by a step whose optimizer state is split over data (ZeRO-1):
# `scatter(path, params) -> tree` of the dimension each of a stack's `params` (at module `path`) is
# reduce-scattered onto, or None where it is summed whole.
_GRADIENTS_SCATTERED: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_gradients_scattered",
                                                                                     default=None)


def gradients_scattered_by(scatter: Callable | None):
    """Context manager installing where a loop leaves the weights' gradients it sums over data."""
    return installed(_GRADIENTS_SCATTERED, scatter)


def gradient_scatter(path: tuple[str, ...], params):
    """The tree of scatter dimensions of the stack `params` at module `path` (`gradients_scattered_by`), or None."""
    scatter = _GRADIENTS_SCATTERED.get()
    return None if scatter is None else scatter(path, params)


# The dtype a loop that sums the weights' gradients over micro-batches itself (a 1F1B pipeline's
# ticks) keeps its accumulators in, installed by the step (`grad_accumulate_dtype`); None: the
# gradients' own.
_GRADIENTS_ACCUMULATED: contextvars.ContextVar[str | None] = contextvars.ContextVar("xlaopt_gradients_accumulated",
                                                                                    default=None)


def gradients_accumulated_in(dtype: str | None):
    """Context manager installing the dtype a loop accumulates the weights' gradients in."""
    return installed(_GRADIENTS_ACCUMULATED, dtype)


def accumulated_dtype(like) -> jnp.dtype:
    """The dtype an accumulator of `like`'s gradients holds (`gradients_accumulated_in`)."""
    dtype = _GRADIENTS_ACCUMULATED.get()
    return jnp.dtype(dtype) if dtype is not None and jnp.issubdtype(like.dtype, jnp.floating) else like.dtype

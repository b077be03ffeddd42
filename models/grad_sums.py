"""How a loop that sums the weights' gradients itself (a 1F1B pipeline's ticks, the micro-batch loop
manual over data) sums them over micro-batches and over the mesh, and where it leaves them: what the
step installs while the model is traced, read where the loop is written.

- `gradients_summed_by`: the sum over the manual axes, crossing them in the dtype the step reduces
  gradients in (`micro_batches.summed_in`);
- `gradients_accumulated_in`: the dtype the loop's accumulators hold (`grad_accumulate_dtype`);
- `gradients_scattered_by`: under ZeRO-1, the split each data replica keeps its share of a
  stacked weight's gradient by (`sharding.data_scatter_specs`).
"""
from __future__ import annotations

import contextvars
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from xlaopt.mesh import DATA
from xlaopt.models.tracing import installed
from xlaopt.sharding import entry_axes

# How a loop that sums the weights' gradients over data itself (a 1F1B pipeline's ticks) sums
# them: `sum(g, axes, scatter_dim=None)`, crossing the axes in the dtype the step reduces gradients in
# and returned in it (`micro_batches.summed_in`); `reduced_over` unless a step installs one.
_GRADIENTS_SUMMED: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_gradients_summed",
                                                                                   default=None)


def gradients_summed_by(sum_fn: Callable):
    """Context manager installing how a loop sums the weights' gradients over data itself."""
    return installed(_GRADIENTS_SUMMED, sum_fn)


def reduced_over(g, axes: tuple[str, ...], scatter_dim: int | None = None):
    """`g` summed over the manual `axes`; with `scatter_dim`, reduce-scattered over `data` (one of
    `axes`) onto that dimension, each replica keeping its share of the sum (ZeRO-1,
    `gradients_scattered_by`): half the all-reduce's bytes, as Megatron's distributed optimizer
    reduces. Where `g` is split over axes the partitioner places, call it manual over those too
    (`scattered_share`): XLA gathered such a gradient over them before the reduce-scatter
    (calibration row R13: tensor's 4x the bytes)."""
    if scatter_dim is None:
        return jax.lax.psum(g, axes)
    rest = tuple(a for a in axes if a != DATA)
    return jax.lax.psum_scatter(jax.lax.psum(g, rest) if rest else g, DATA, scatter_dimension=scatter_dim, tiled=True)


def summed_gradients(tree, axes: tuple[str, ...], scatter_dim: int | None = None):
    """`tree`'s gradients summed over `axes` as the step sums them (`gradients_summed_by`), each
    reduce-scattered over data onto `scatter_dim` where given."""
    sum_fn = _GRADIENTS_SUMMED.get() or reduced_over
    return jax.tree.map(lambda g: sum_fn(g, axes) if scatter_dim is None else sum_fn(g, axes, scatter_dim), tree)


def scattered_share(g, spec: PartitionSpec, lead: int, axes: tuple[str, ...], manual: tuple[str, ...],
                    sum_fn: Callable | None = None):
    """A weight's gradient `g` summed over `axes` (by `sum_fn(g, axes, dim)`, else as
    `summed_gradients` sums), each data replica keeping the share of it `spec` gives it: the
    weight's ZeRO-1 split, data alone on one dimension (`sharding.data_scatter_specs`). `g` is in
    a loop manual over `manual` and `data`, with `lead` dimensions more than the weight before its
    own (a 1F1B stage's chunks, [V, k, ...] for the weight's [L, ...]: one). Reduce-scattered in a
    shard_map manual over the axes besides that split `g`."""
    sum_fn = sum_fn or _GRADIENTS_SUMMED.get() or reduced_over
    entries = list(spec) + [None] * (g.ndim - lead - len(spec))
    dim = lead + next(d for d, e in enumerate(entries) if entry_axes(e) == (DATA,))
    auto = [tuple(a for a in entry_axes(e) if a not in (*manual, DATA)) for e in entries]
    names = {a for axes_ in auto for a in axes_}
    if not names:
        return sum_fn(g, axes, dim)
    inner = PartitionSpec(*[None] * lead, *[a or None for a in auto])
    return jax.shard_map(lambda x: sum_fn(x, axes, dim), in_specs=inner, out_specs=inner, axis_names=names,
                         check_vma=False)(g)


def share_specs(shares, manual_first: str | None = None):
    """The out specs, in a shard_map manual over data, of gradients left as `shares` (a tree of
    ZeRO-1 splits, `sharding.data_scatter_specs`) gives them: data where a split puts it alone,
    nothing where there is none (summed whole); `manual_first`, where given, on the first
    dimension of each (a pipeline's stage)."""
    def out(spec):
        entries = [DATA if entry_axes(e) == (DATA,) else None for e in (spec or ())]
        return PartitionSpec(manual_first, *entries[1:]) if manual_first else PartitionSpec(*entries)

    return jax.tree.map(out, shares, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))


# Where a loop that sums the weights' gradients over data itself (a 1F1B pipeline's ticks) leaves
# each over data, installed by a step whose optimizer state is split over data (ZeRO-1):
# `scatter(path, params) -> tree` of each of a stack's `params` (at module `path`): its ZeRO-1 split
# where the loop hands each replica its share of the gradient, None where it is summed whole.
_GRADIENTS_SCATTERED: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_gradients_scattered",
                                                                                     default=None)


def gradients_scattered_by(scatter: Callable | None):
    """Context manager installing where a loop leaves the weights' gradients it sums over data."""
    return installed(_GRADIENTS_SCATTERED, scatter)


def gradient_scatter(path: tuple[str, ...], params):
    """The tree of ZeRO-1 splits of the stack `params` at module `path` (`gradients_scattered_by`), or None."""
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

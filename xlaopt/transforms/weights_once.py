"""The loss's work on the weights alone, run once a step before the micro-batch loop.

A micro-batch's gradient function reads the step's weights, which do not change inside the loop,
and the micro-batch. Whatever it computes from the weights alone is the same at every micro-batch:
fp8's per-tensor quantization of each weight (its absolute maximum, then the cast) and the copies
its backward GEMMs read (the fp8 weight transposed, contracted dimension innermost, which an fp8
GEMM needs). XLA's GPU program ran that work at every micro-batch; Transformer Engine quantizes a
weight and keeps its transpose on the first micro-batch of a step and reuses both
(`is_first_microbatch`), which is what the published fp8 runs did.

`split` cuts the gradient function by JAX's partial evaluation (the weights known, the
micro-batch not; `jax`'s remat machinery, `partial_eval_jaxpr_custom`): `once(weights)` computes
what depends on the weights alone and is worth holding across the loop (`_held`: fp8 weights, their
transposes and scales, the memory Transformer Engine's cache costs), and `each(held, weights,
*rest)` the rest, at every micro-batch, the same operations in the same order: the gradients are
the same bit for bit. `models.pipeline_1f1b` splits its ticks likewise.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # not in jax's public modules (0.10.2)
from jax.extend.core import jaxpr_as_fun

from xlaopt.models.fp8 import BACKWARD, FORWARD

# What `once` holds across the loop: fp8 values (a weight quantized, a transposed copy of it) and
# what is computed from scalars alone (their scales). Everything else of the weights' own work
# stays in the loop: held, the fp32 weights a recomputed layer reads (8 GiB a device on Llama 3
# 8B, fsdp=8, Megatron's selective recomputation) or the zeros a scan's backward starts its
# gradient buffers from (3.9 GiB) cost more memory than the loop saves.
FP8_DTYPES = (jnp.dtype(FORWARD), jnp.dtype(BACKWARD))


def _held(prim, *avals, **params) -> bool:
    if prim.name == "convert_element_type":
        return jnp.dtype(params["new_dtype"]) in FP8_DTYPES
    if prim.name in ("broadcast_in_dim", "iota"):  # of a scalar, but as large as it is made
        return False
    return all(a.ndim == 0 for a in avals) or any(a.dtype in FP8_DTYPES for a in avals)


def split(fn: Callable, weights, *rest) -> tuple[Callable, Callable]:
    """(once, each) with `each(once(weights), weights, *rest_i) == fn(weights, *rest_i)` for every
    `rest_i` shaped as `rest` (arrays or `jax.ShapeDtypeStruct`s). `once(weights) -> held` runs
    what `fn` computes from `weights` alone and `_held` keeps; `each` the rest."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(weights, *rest)
    jaxpr, consts = pe.convert_constvars_jaxpr(closed.jaxpr), closed.consts  # the consts: known inputs
    n_known = len(consts) + len(jax.tree.leaves(weights))
    unknown_in = [i >= n_known for i in range(len(jaxpr.invars))]
    # Every output from `each`, which gets every input beside what `once` held.
    known, staged, _, _, _ = pe.partial_eval_jaxpr_custom(jaxpr, unknown_in, True, True, True, _held)
    # The staged side makes again every known value not held, needed or not: only those it reads.
    staged, _ = pe.dce_jaxpr(staged, [True] * len(staged.outvars), instantiate=True)
    known_fn, staged_fn = jaxpr_as_fun(pe.close_jaxpr(known)), jaxpr_as_fun(pe.close_jaxpr(staged))
    out_tree = jax.tree.structure(out_shape)

    def once(weights):
        return list(known_fn(*consts, *jax.tree.leaves(weights)))

    def each(held, weights, *rest):
        return jax.tree.unflatten(out_tree, staged_fn(*held, *consts, *jax.tree.leaves(weights),
                                                      *jax.tree.leaves(rest)))

    return once, each


def in_layouts(shapes, specs) -> Callable:
    """`hold(values)`: each value shaped as one of `shapes` constrained to the `specs` entry (a
    PartitionSpec) of that shape, where only one has it; the rest left to the partitioner."""
    found: dict[tuple, set] = {}
    for shape, spec in zip(shapes, specs):
        found.setdefault(tuple(shape), set()).add(spec)
    layout = {shape: next(iter(s)) for shape, s in found.items() if len(s) == 1}
    return lambda held: [jax.lax.with_sharding_constraint(h, layout[h.shape]) if h.shape in layout else h
                         for h in held]

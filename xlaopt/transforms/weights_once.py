"""The loss's work on the weights alone, run once a step before the micro-batch loop.

A micro-batch's gradient function reads the step's weights, which do not change inside the loop,
and the micro-batch. Whatever it computes from the weights alone is the same at every micro-batch:
fp8's per-tensor quantization of each weight (its absolute maximum, then the cast) and the copies
its backward GEMMs read (the fp8 weight transposed, contracted dimension innermost, which an fp8
GEMM needs). XLA's GPU program ran that work at every micro-batch; Transformer Engine quantizes a
weight and keeps its transpose on the first micro-batch of a step and reuses both
(`is_first_microbatch`), which is what the published fp8 runs did.

`split` cuts the gradient function by JAX's partial evaluation (the weights known, the
micro-batch not): `once(weights)` computes what depends on the weights alone, once, and
`each(held, *rest)` the rest, at every micro-batch. Nothing is recomputed or reordered inside
either part, and the loop-invariant values it moves out of the loop are held across it (the
memory Transformer Engine's cache costs). `models.pipeline_1f1b` splits its ticks the same way.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax._src.interpreters.partial_eval import partial_eval_jaxpr_nounits  # not in jax's public module (0.10.2)
from jax.extend.core import jaxpr_as_fun


def split(fn: Callable, weights, *rest) -> tuple[Callable, Callable]:
    """(once, each) with `each(once(weights), *rest_i) == fn(weights, *rest_i)` for every `rest_i`
    shaped as `rest` (arrays or `jax.ShapeDtypeStruct`s). `once(weights) -> held` runs what `fn`
    computes from `weights` alone; `each` the rest."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(weights, *rest)
    n_weights = len(jax.tree.leaves(weights))
    unknown_in = [i >= n_weights for i in range(len(closed.in_avals))]
    # instantiate: every output from `each`, so `once` returns only what `each` reads.
    known, unknown, _, _ = partial_eval_jaxpr_nounits(closed, unknown_in, instantiate=True)
    known_fn, unknown_fn = jaxpr_as_fun(known), jaxpr_as_fun(unknown)
    out_tree = jax.tree.structure(out_shape)

    def once(weights):
        return list(known_fn(*jax.tree.leaves(weights)))

    def each(held, *rest):
        return jax.tree.unflatten(out_tree, unknown_fn(*held, *jax.tree.leaves(rest)))

    return once, each

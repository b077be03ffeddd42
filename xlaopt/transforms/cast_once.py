"""The weights cast to the compute dtype once a step, before the loop that reads them.

A model reads its fp32 master weights cast to the compute dtype (`w.astype(bf16)` where a layer
uses them). Inside a step's micro-batch loop that cast ran again at every micro-batch: on Llama 3
8B's R11 (32 micro-batches, XLA's GPU program) each weight was read in fp32 and written in bf16
per layer and micro-batch, forward and backward, its fp32 gradient written into a stacked buffer
zeroed and copied for it and then added to the sum. Megatron keeps bf16 copies of the weights that
its optimizer refreshes once a step.

Here the step does the same where it changes no number: a parameter the loss reads exactly once,
through a cast to a narrower float dtype, is cast once before the loop, and the loop
differentiates with respect to the cast copy. Its gradient comes back in that dtype, as the cast's
cotangent did, and is widened (`widened`) as the cast's transpose widened it, before anything adds
it to another: the same values, bit for bit (`tests/test_cast_once.py`).

"Exactly once" is read from the loss's jaxpr, traced where the step traces it (inside the grad
transforms' shard_maps and hooks): the cast may sit inside calls, recomputation and a scan that
slices the parameter per iteration (a layer stack), after data movement (reshape, transpose,
slices), in either branch of a cond. A parameter read anywhere else keeps its reads: read
uncast (a norm's scale, an embedding table looked up in fp32), cast twice or cast to two dtypes
(its cotangents would be summed in the narrow dtype), read at every iteration of a scan (the
same: a pipeline's ticks), or handed to a custom derivative or a shard_map, whose backward may
do anything with its cotangent in the dtype it gets (a gradient hook reducing it).
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

# Primitives whose sub-jaxprs take their operands one for one as invars.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint")
# Data movement whose transpose adds nothing up (so commutes with a cast in both directions);
# operand 0 is the moved array.
_MOVES = ("reshape", "transpose", "squeeze", "expand_dims", "sharding_constraint", "copy", "copy_p", "slice",
          "dynamic_slice", "rev")

_PROBE: contextvars.ContextVar[list | None] = contextvars.ContextVar("xlaopt_cast_once_probe", default=None)


@contextlib.contextmanager
def probing():
    """Context manager collecting the loss jaxprs `note_loss` sees while a step is traced."""
    seen: list = []
    token = _PROBE.set(seen)
    try:
        yield seen
    finally:
        _PROBE.reset(token)


def note_loss(loss, params) -> None:
    """Under `probing`, keep `loss(params)`'s jaxpr (its invars: `params`' leaves, in order)."""
    seen = _PROBE.get()
    if seen is not None:
        seen.append(jax.make_jaxpr(loss)(params).jaxpr)


def cast_dtypes(jaxpr, params):
    """For each leaf of `params` (the invars of `jaxpr`, a loss): the narrower float dtype the loss
    reads it cast to exactly once, or None (module docstring)."""
    leaves, treedef = jax.tree.flatten(params)
    found = []
    for leaf, var in zip(leaves, jaxpr.invars):
        casts = _casts(jaxpr, var) if jnp.issubdtype(leaf.dtype, jnp.floating) else None
        narrower = casts is not None and len(casts) == 1 and _bits(casts[0]) < _bits(leaf.dtype)
        found.append(casts[0] if narrower else None)
    return jax.tree.unflatten(treedef, found)


def _bits(dtype) -> int:
    return jnp.finfo(dtype).bits


def _casts(jaxpr, var) -> list | None:
    """The dtypes of every cast of `var` in `jaxpr` (a cond's branches counted once: one runs), or
    None where it is read otherwise."""
    if var in jaxpr.outvars:
        return None
    casts: list = []
    for eqn in jaxpr.eqns:
        for position, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            found = _casts_in(jaxpr, eqn, position)
            if found is None:
                return None
            casts += found
    return casts


def _casts_in(jaxpr, eqn, position: int) -> list | None:
    """`_casts` of operand `position` of `eqn`, an equation of `jaxpr`."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        return [jnp.dtype(eqn.params["new_dtype"])]
    if name in _MOVES:
        return _casts(jaxpr, eqn.outvars[0]) if position == 0 else None
    subs = [v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v for v in eqn.params.values()
            if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]
    if name == "scan":
        num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        if position < num_consts + num_carry:  # read at every iteration, or carried
            return None
        return _casts(subs[0], subs[0].invars[position])
    if name == "cond":
        branches = [b.jaxpr for b in eqn.params["branches"]]
        per_branch = [_casts(b, b.invars[position - 1]) for b in branches] if position else [None]
        if any(c is None for c in per_branch):
            return None
        read = [c for c in per_branch if c]
        return read[0] if read and all(c == read[0] for c in read) else sum(read, [])
    if name in _CALLS or name.startswith("remat"):
        inner = [s for s in subs if len(s.invars) == len(eqn.invars)]
        if len(inner) != 1:
            return None
        return _casts(inner[0], inner[0].invars[position])
    return None


def cast(params, dtypes):
    """`params` with each leaf whose dtype in `dtypes` is not None cast to it."""
    return jax.tree.map(lambda p, d: p if d is None else p.astype(d), params, dtypes,
                        is_leaf=lambda x: x is None)


def widened(grads):
    """`grads` with each narrower float leaf in float32, the master weights' dtype
    (`xlaopt.execution`): a cast weight's gradient as the cast's transpose returned it."""
    return jax.tree.map(lambda g: g.astype(jnp.float32) if _narrower(g.dtype) else g, grads)


def _narrower(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and _bits(dtype) < 32

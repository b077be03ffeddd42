"""A jaxpr evaluated with some of its inputs read from a stack of them, in place.

A pipeline stage's chunks of layers sit in one stack per weight, [V, k, ...] (V chunks of k
layers). A tick runs chunk v through the layer scan, which reads layer i of the chunk at each
iteration. Written the plain way, `stack[v]` is sliced out first and the scan slices that again.
XLA's GPU compile cannot merge the two slices across the scan's loop boundary, so every tick
copied the whole chunk (each weight's fp8 cast, for the forward and for the backward) before
the loop read it: calibration row R13, GPT-3 175B over 8 stages x 6 virtual, 0.28 s of its
step. Megatron reads each chunk's weights where they lie.

`evaluate_reading_stacks` runs the jaxpr as JAX's own evaluator would, except that a scan
which takes one of the stacked inputs as a scanned operand reads `stack[v, i]` at iteration i,
one dynamic slice of the whole stack. A stacked input used anywhere else (a scan's constant, an
op outside a scan) is sliced to `stack[v]` there, as before. The numbers are the same; only
where the slice happens changes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import source_info_util  # the ops' name stacks, kept as JAX's evaluator keeps them
from jax.extend import core as jcore


def _chunk_of(stack, v):
    return jax.lax.dynamic_index_in_dim(stack, v, 0, keepdims=False)


def _layer_of(stack, v, i):
    """stack[v, i], one dynamic slice."""
    zeros = (0,) * (stack.ndim - 2)
    return jax.lax.dynamic_slice(stack, (v, i, *zeros), (1, 1, *stack.shape[2:])).reshape(stack.shape[2:])


def _scan_reading(eqn, read, stacks: dict, v):
    """The outputs of `eqn` (a scan) with each scanned operand that is a stacked input read at
    (v, iteration) inside the loop."""
    p = eqn.params
    n_consts, n_carry, body = p["num_consts"], p["num_carry"], p["jaxpr"]
    consts = [read(x) for x in eqn.invars[:n_consts]]
    carry = [read(x) for x in eqn.invars[n_consts:n_consts + n_carry]]
    scanned = eqn.invars[n_consts + n_carry:]
    from_stack = [isinstance(x, jcore.Var) and x in stacks for x in scanned]
    rest = [read(x) for x, s in zip(scanned, from_stack) if not s]

    def step(carry, xs):
        i, it = xs[0], iter(xs[1:])
        operands = [_layer_of(stacks[x], v, i) if s else next(it) for x, s in zip(scanned, from_stack)]
        outs = jcore.jaxpr_as_fun(body)(*consts, *carry, *operands)
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(step, carry, (jnp.arange(p["length"]), *rest), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def evaluate_reading_stacks(closed: jcore.ClosedJaxpr, stacks: list, v, *args) -> list:
    """The outputs of `closed` on (`stack[v]` for each of `stacks`, then `args`): its first
    len(stacks) inputs are chunk v of each [V, ...] stack, read in place where a scan scans them."""
    jaxpr = closed.jaxpr
    lazy = dict(zip(jaxpr.invars[:len(stacks)], stacks))
    env = dict(zip(jaxpr.constvars, closed.consts)) | dict(zip(jaxpr.invars[len(stacks):], args))

    def read(x):
        if isinstance(x, jcore.Literal):
            return x.val
        if x not in env:  # a stacked input read whole: its chunk, sliced out once
            env[x] = _chunk_of(lazy[x], v)
        return env[x]

    for eqn in jaxpr.eqns:
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            reads_stack = eqn.primitive.name == "scan" and any(
                isinstance(x, jcore.Var) and x in lazy
                for x in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:])
            if reads_stack:
                outs = _scan_reading(eqn, read, lazy, v)
            else:
                outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(x) for x in jaxpr.outvars]

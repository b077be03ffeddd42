"""A jaxpr evaluated with stacks of layers held apart, one buffer a layer, its layer scans unrolled.

A pipeline stage keeps its chunks of layers stacked, [V, k, ...] a weight (V chunks of k layers),
and a 1F1B tick runs one chunk through the layer scan. XLA's GPU compile feeds a GEMM from a
buffer of its own: a slice of a stack, static or dynamic, is copied out first (its Triton GEMMs
take no slice; `xla_gpu_enable_dynamic_slice_fusion` fails in the deviceless compile). Under the
scan every layer's weights were copied at every tick, and the scan stacked every layer's weight
gradients before they were added to the accumulators: calibration row R13, GPT-3 175B over 8
stages x 6 virtual, 1.1 s of its step. Megatron runs a chunk's layers one after another, each on
its own weights, and writes each layer's gradients where they accumulate.

`Layers` holds a stack as its layers, each its own buffer (split once a step, outside the tick
loop). `evaluate_by_layer` runs a jaxpr as JAX's evaluator would, except that a scan scanning a
`Layers` operand is unrolled: iteration i reads layer i, and what the scan would stack comes back
as `Layers` too, never stacked unless an op other than such a scan reads it. The numbers are
the same; only the buffers change.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import source_info_util  # the ops' name stacks, kept as JAX's evaluator keeps them
from jax.extend import core as jcore


@jax.tree_util.register_pytree_node_class
class Layers:
    """A stack [k, ...] held as its k layers, [...] each (a pytree: its layers are its leaves)."""

    def __init__(self, layers):
        self.layers = tuple(layers)

    def tree_flatten(self):
        return self.layers, None

    @classmethod
    def tree_unflatten(cls, _, layers):
        return cls(layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def stacked(self):
        return jnp.stack(self.layers)


def is_layers(x) -> bool:
    return isinstance(x, Layers)


def apart(stack) -> Layers:
    """`stack` [k, ...] as its k layers (static slices: XLA copies each once, where it is split)."""
    return Layers(stack[i] for i in range(stack.shape[0]))


def scanned_inputs(closed: jcore.ClosedJaxpr) -> list[bool]:
    """For each input of `closed`, whether a scan at its top level scans it: an input that
    `evaluate_by_layer` reads a layer at a time when it is given as `Layers`."""
    scanned = set()
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "scan":
            scanned.update(x for x in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:]
                           if isinstance(x, jcore.Var))
    return [x in scanned for x in closed.jaxpr.invars]


def _unrolled(eqn, read, value):
    """The outputs of `eqn` (a scan) run one iteration after another, iteration i on layer i of
    each scanned operand; its stacked outputs as `Layers`."""
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    body = jcore.jaxpr_as_fun(p["jaxpr"])
    consts = [read(x) for x in eqn.invars[:n_consts]]
    carry = [read(x) for x in eqn.invars[n_consts:n_consts + n_carry]]
    scanned = [value(x) for x in eqn.invars[n_consts + n_carry:]]
    ys = [[None] * length for _ in p["jaxpr"].out_avals[n_carry:]]
    for i in reversed(range(length)) if p["reverse"] else range(length):
        outs = body(*consts, *carry, *(x[i] for x in scanned))
        carry = list(outs[:n_carry])
        for stack, y in zip(ys, outs[n_carry:]):
            stack[i] = y
    return [*carry, *map(Layers, ys)]


def evaluate_by_layer(closed: jcore.ClosedJaxpr, *args) -> list:
    """The outputs of `closed` on `args`, any of which may be `Layers` in place of a stack. A scan
    that scans a `Layers` value is unrolled (`_unrolled`) and its stacked outputs are `Layers`;
    any other op reading a `Layers` value reads it stacked."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts)) | dict(zip(jaxpr.invars, args))

    def value(x):
        return x.val if isinstance(x, jcore.Literal) else env[x]

    def read(x):
        v = value(x)
        return v.stacked() if isinstance(v, Layers) else v

    for eqn in jaxpr.eqns:
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            by_layer = eqn.primitive.name == "scan" and any(
                isinstance(x, jcore.Var) and isinstance(env[x], Layers)
                for x in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:])
            if by_layer:
                outs = _unrolled(eqn, read, value)
            else:
                outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [value(x) for x in jaxpr.outvars]

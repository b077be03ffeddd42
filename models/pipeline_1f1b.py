"""1F1B: the pipeline's backward interleaved with its forward, so a stage holds the activations
of at most 2P - 1 micro-batches instead of every tick's.

JAX's transpose of the GPipe tick loop (`xlaopt.models.pipeline`) runs every forward tick before
the first backward tick. Here the loop is written out by hand, forward and backward in one scan,
and the loss comes inside it: a micro-batch's backward starts on the last stage right after its
forward, so the layers after the stack (the `tail`: final norm, head, loss) run there, on that
micro-batch alone. The whole loop is one `custom_vjp` whose forward returns the loss and keeps
the gradients it computed, and whose backward scales them by the loss's cotangent.

Ticks run in lockstep: at tick t stage p runs the forward of micro-batch t - p and the backward
of micro-batch t - (2P - 2 - p); the last stage runs both for the same micro-batch, its cotangent
straight from the tail. Activations go up the ring and cotangents down it, one `ppermute` each
way a tick; M + 2P - 2 ticks. A forward keeps its `jax.vjp` residuals in a ring of
min(M, 2P - 1) slots that its backward reads back (stage 0 holds a micro-batch longest, 2P - 2
ticks); residuals that depend on the weights alone (their casts, their transposes) are computed
once a step, not kept per slot. Each stage's forward, tail and backward sit under `lax.cond` (the
sends outside it), so a stage that has nothing to run in a tick runs nothing: a tick costs the
busiest stage's work, and the step (M + P - 1) (F + B), GPipe's.

Manual over the same axes as GPipe's loop (`stage`, `data` where it splits the rows, Ulysses'
`context`); the gradients this loop computes itself are summed over them explicitly.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.interpreters import partial_eval as pe
from jax.sharding import PartitionSpec

from xlaopt.mesh import STAGE
from xlaopt.models.layers import manual_axes, manual_over, rows_split_over
from xlaopt.models.pipeline import BRANCH_SCOPE, PipelineSchedule, _micro_batching, stages_of_mesh

# (tail_params, y_mb, tail_args_mb, extra) -> this micro-batch's share of the loss, and of each
# metric ({name: scalar}, reported, not differentiated)
Tail = Callable


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _no_cotangent(x):
    return np.zeros(np.shape(x), jax.dtypes.float0) if not _inexact(x) else jnp.zeros_like(x)


def pipeline_loss_1f1b(layer_fn: Callable, params_L, carry, args: tuple, tail: Tail, tail_params, tail_args,
                       extra, microbatches: int, inner: Callable, gather: Callable | None = None):
    """(loss, metrics) of `tail` after the layers of `params_L` ([L, ...] leaves) over `carry`,
    summed over micro-batches, with the loss's gradients by the 1F1B schedule over the stages.

    `tail(tail_params, y, tail_args_m, extra)` is one micro-batch's share of the loss and of each
    metric (the sum of the shares is the loss, or the metric). `args` and `tail_args` lead with
    the rows like `carry`; `tail_args` and `extra` are data (no gradient flows into them).
    `inner` and `gather` as in `pipeline_layers`. One stage: `inner` then `tail` on the whole
    batch, the same numbers."""
    stages = stages_of_mesh()
    if stages == 1:
        return tail(tail_params, inner(layer_fn, params_L, carry, args), tail_args, extra)
    schedule = PipelineSchedule(stages, microbatches or stages, "1f1b")
    schedule.check_layers(jax.tree.leaves(params_L)[0].shape[0])
    for leaf in jax.tree.leaves(carry):
        if not _inexact(leaf):
            raise ValueError(f"1F1B pipeline: the layer stack's carry must be floating point, got {leaf.dtype}")
    data, seq, row_axes, split, merge = _micro_batching((carry, tail_args), args, schedule.microbatches, stages)
    manual = tuple(a for a in (STAGE, data, seq) if a)
    run = _loop(layer_fn, tail, inner, gather, schedule, split, data, seq)

    def step(params_L, tail_params, carry, args, tail_args, extra):
        inputs = PartitionSpec(data, seq)
        out_rows = PartitionSpec(data, STAGE, None, seq)
        with manual_over(manual_axes() + manual), rows_split_over(row_axes):
            loss, grads = jax.shard_map(
                run, in_specs=(PartitionSpec(STAGE), PartitionSpec(), inputs, inputs, inputs, PartitionSpec()),
                out_specs=((PartitionSpec(), PartitionSpec()),
                           (PartitionSpec(STAGE), PartitionSpec(), out_rows, out_rows)),
                axis_names=set(manual), check_vma=False)(params_L, tail_params, carry, args, tail_args, extra)
        d_params, d_tail, d_carry, d_float_args = grads
        return loss, (d_params, d_tail, jax.tree.map(merge, d_carry), [merge(d) for d in d_float_args])

    @jax.custom_vjp
    def loss_of(params_L, tail_params, carry, args, tail_args, extra):
        return step(params_L, tail_params, carry, args, tail_args, extra)[0]

    def forward(params_L, tail_params, carry, args, tail_args, extra):
        loss, grads = step(params_L, tail_params, carry, args, tail_args, extra)
        return loss, (grads, args, tail_args, extra)

    def backward(saved, g):
        g, _ = g  # the metrics' cotangents: reported values, not differentiated
        (d_params, d_tail, d_carry, d_args), args, tail_args, extra = saved
        scale = lambda tree: jax.tree.map(lambda d: (g * d).astype(d.dtype), tree)  # noqa: E731
        d_float = iter(scale(d_args))
        d_args = jax.tree.map(lambda a: next(d_float) if _inexact(a) else _no_cotangent(a), args)
        return (scale(d_params), scale(d_tail), scale(d_carry), d_args, jax.tree.map(_no_cotangent, tail_args),
                jax.tree.map(_no_cotangent, extra))

    loss_of.defvjp(forward, backward)
    return loss_of(params_L, tail_params, carry, args, tail_args, extra)


def _residual_split(fwd: Callable, params_k, x, a_float, a_rest):
    """(per_microbatch, rebuild, kept_avals) for the vjp residuals of `fwd(params_k, x, a_float,
    a_rest)` (differentiated in the first three): which of its leaves depend on the micro-batch,
    `rebuild(kept) -> vjp` from those leaves (the others computed once, from the weights alone),
    and their shapes. A leaf depends on the micro-batch where the jaxpr that makes it, dead code
    removed, reads one of its inputs."""
    def vjp_of(p, x, af, ar):
        return jax.vjp(lambda p, x, af: fwd(p, x, af, ar), p, x, af)[1]

    inputs = jax.tree.leaves((params_k, x, a_float, a_rest))
    n_weights = len(jax.tree.leaves(params_k))
    treedef = jax.tree.structure(jax.eval_shape(vjp_of, params_k, x, a_float, a_rest))
    closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(vjp_of(*a)))(params_k, x, a_float, a_rest)
    n_out = len(closed.out_avals)
    per_microbatch = [any(pe.dce_jaxpr_consts(closed.jaxpr, [j == i for j in range(n_out)])[2][n_weights:])
                      for i in range(n_out)]
    jaxpr, used_consts, used_inputs = pe.dce_jaxpr_consts(closed.jaxpr, [not v for v in per_microbatch])
    consts = [c for c, u in zip(closed.consts, used_consts) if u]
    once = jaxpr_as_fun(ClosedJaxpr(jaxpr, consts))(*[a for a, u in zip(inputs, used_inputs) if u])

    def rebuild(kept):
        it_once, it_kept = iter(once), iter(kept)
        return jax.tree.unflatten(treedef, [next(it_kept) if v else next(it_once) for v in per_microbatch])

    return per_microbatch, rebuild, [a for a, v in zip(closed.out_avals, per_microbatch) if v]


def _zeros_of(fn: Callable, *operands) -> Callable:
    """A `lax.cond` branch that runs nothing: `fn`'s results' shapes, zero."""
    shapes = jax.eval_shape(fn, *operands)
    return lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _reduced(acc, summed: tuple[str, ...]):
    """(loss, gradients) of the device from the tick loop's sums: the weights' summed over the
    manual axes that split the rows, the loss and the tail's over those and the stages. Only
    stage 0 wrote the carry's gradient and every stage its share of the args': the sum over
    `stage` hands each its micro-batches' rows, as GPipe's loop hands its output."""
    d_params, d_tail, d_carry, d_args, reported = acc
    scatter = lambda d: jax.lax.psum_scatter(d, STAGE, scatter_dimension=0, tiled=True)[None]  # noqa: E731
    if summed:
        d_params = jax.lax.psum(d_params, summed)
    return (jax.lax.psum(reported, (STAGE, *summed)),
            (d_params, jax.lax.psum(d_tail, (STAGE, *summed)), jax.tree.map(scatter, d_carry),
             jax.tree.map(scatter, d_args)))


def _loop(layer_fn, tail, inner, gather, schedule: PipelineSchedule, split, data, seq):
    """The shard_map's body: (loss, (weight, tail, carry and float args' gradients)) of this device."""
    P, M = schedule.stages, schedule.microbatches
    slots = schedule.saved_ticks
    summed = tuple(a for a in (data, seq) if a)

    def local(params_k, tail_params, carry, args, tail_args, extra):
        if gather is not None:
            params_k = gather(params_k)
        carry_M, args_M, tail_args_M = (jax.tree.map(split, t) for t in (carry, args, tail_args))
        stage = jax.lax.axis_index(STAGE)
        first, last = stage == 0, stage == P - 1
        take = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
        diff, a_def = [_inexact(a) for a in jax.tree.leaves(args)], jax.tree.structure(args)

        def parts(a):  # args -> (float leaves, the rest): only the float ones are differentiated
            leaves = jax.tree.leaves(a)
            return [x for x, d in zip(leaves, diff) if d], [x for x, d in zip(leaves, diff) if not d]

        def fwd(p, x, a_float, a_rest):
            it_f, it_r = iter(a_float), iter(a_rest)
            return inner(layer_fn, p, x, jax.tree.unflatten(a_def, [next(it_f) if d else next(it_r) for d in diff]))

        x0 = take(carry_M, 0)
        per_mb, vjp_of, kept_avals = _residual_split(fwd, params_k, x0, *parts(take(args_M, 0)))

        def forward(x, af, ar):
            y, vjp = jax.vjp(lambda p, x, af: fwd(p, x, af, ar), params_k, x, af)
            return y, [r for r, v in zip(jax.tree.leaves(vjp), per_mb) if v]

        def tail_grad(y, ta):
            (loss, metrics), (d_tail, dy) = jax.value_and_grad(tail, argnums=(0, 1), has_aux=True)(
                tail_params, y, ta, extra)
            as_f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
            return (as_f32(loss), jax.tree.map(as_f32, metrics)), d_tail, dy

        def backward(d_params, kept, dy):
            dp, dx, da = vjp_of(kept)(dy)
            return jax.tree.map(jnp.add, d_params, dp), dx, da

        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731

        def tick(state, t):
            handed_y, handed_dy, ring, (d_params, d_tail, d_carry, d_args, reported) = state
            f, b = t - stage, t - (2 * P - 2 - stage)
            f_ok, b_ok = (f >= 0) & (f < M), (b >= 0) & (b < M)
            fm, bm = jnp.clip(f, 0, M - 1), jnp.clip(b, 0, M - 1)
            x = jax.tree.map(lambda own, h: jnp.where(first, own, h), take(carry_M, fm), handed_y)
            af, ar = parts(take(args_M, fm))
            with jax.named_scope(BRANCH_SCOPE.format("forward")):
                y, kept = jax.lax.cond(f_ok, forward, _zeros_of(forward, x, af, ar), x, af, ar)
            ring = [r.at[fm % slots].set(jnp.where(f_ok, k, r[fm % slots])) for r, k in zip(ring, kept)]
            ta = take(tail_args_M, fm)
            with jax.named_scope(BRANCH_SCOPE.format("tail")):
                l, dt, dy_tail = jax.lax.cond(last & f_ok, tail_grad, _zeros_of(tail_grad, y, ta), y, ta)
            dy = jax.tree.map(lambda own, h: jnp.where(last, own, h), dy_tail, handed_dy)
            operands = (d_params, [r[bm % slots] for r in ring], dy)
            with jax.named_scope(BRANCH_SCOPE.format("backward")):
                d_params, dx, da = jax.lax.cond(b_ok, backward,
                                                lambda d, *_: (d, *_zeros_of(backward, *operands)()[1:]), *operands)
            d_carry = jax.tree.map(lambda o, n: o.at[bm].add(jnp.where(first & b_ok, n, 0)), d_carry, dx)
            d_args = [o.at[bm].add(jnp.where(b_ok, n, 0)) for o, n in zip(d_args, da)]
            up = jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE, [(p, p + 1) for p in range(P - 1)]), y)
            down = jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE, [(p + 1, p) for p in range(P - 1)]), dx)
            acc = (d_params, jax.tree.map(jnp.add, d_tail, dt), d_carry, d_args, jax.tree.map(jnp.add, reported, l))
            return (up, down, ring, acc), None

        ring = [jnp.zeros((slots, *a.shape), a.dtype) for a in kept_avals]
        acc = (zeros(params_k), zeros(tail_params), zeros(carry_M), zeros(parts(args_M)[0]),
               _zeros_of(tail_grad, x0, take(tail_args_M, 0))()[0])
        (_, _, _, acc), _ = jax.lax.scan(tick, (zeros(x0), zeros(x0), ring, acc), jnp.arange(schedule.ticks))
        return _reduced(acc, summed)

    return local

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
once a step, not kept per slot, and so is what a forward reads of the weights (their casts to the
compute dtype, or to fp8 with their scales): no tick slices the fp32 weights to cast them again.
Over virtual stages they are split once a step into a buffer a layer, and a tick runs its
chunk's few layers one after another, each reading its own (`transforms.layers_apart`: XLA's
GPU compile copies any slice of a stack out before a GEMM reads it), each layer's residuals
written into the ring and each layer's weight gradients into the accumulators, none stacked
first.
Each stage's forward, tail and backward sit under a conditional (a `lax.switch` over the chunks
for the forward and backward; the sends outside), so a stage that has nothing to run in a tick
runs nothing: a tick costs the busiest stage's work, and the step (M + P - 1) (F + B), GPipe's.

Two writes stay outside the conditionals, for XLA's GPU compile (calibration row N10, an 80.2 s
step before either): a bubble tick's forward writes its zeros into a spare slot past the ring,
where a write guarded by a select became a select of the whole ring (21.7 s); and a backward's
weight gradients are added to the accumulators after its conditional, where inside it XLA copied
the accumulators in and out every tick (7.8 s).

Interleaved 1F1B (V virtual stages): each stage's layers in V chunks (chunk vP + p on stage p,
the weights reordered as GPipe's rounds reorder them, their gradients back after the ticks).
Groups of P micro-batches go round the ring V times, one chunk a tick, so the last stage's
result reaches stage 0 the tick its next round starts and no round waits in a buffer; the
backward runs the same units with the rounds reversed, VP + P - 2 - p ticks behind
(`PipelineSchedule.unit`, `backward_lag`). V M + VP + P - 2 ticks of 1 / V of a stage's layers:
the bubble is (P - 1) / V stage times. A stage holds at most (V + 1) P - 1 chunks' residuals,
in a ring of min(V M, 2VP - 1) slots (a slot per tick of the longest wait, stage 0's first
round; slots per round would save about a quarter, not done).

Manual over the same axes as GPipe's loop (`stage`, `data` where it splits the rows, Ulysses'
`context`); the gradients this loop computes itself are summed over them explicitly.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters.partial_eval import partial_eval_jaxpr_nounits  # not in jax's public module (0.10.2)
from jax.extend.core import jaxpr_as_fun
from jax.sharding import PartitionSpec

from xlaopt.mesh import DATA, STAGE
from xlaopt.models.grad_sums import accumulated_dtype, scattered_share, share_specs, summed_gradients
from xlaopt.models.layers import manual_axes, manual_over, rows_split_over
from xlaopt.models.pipeline import BRANCH_SCOPE, PipelineSchedule, _micro_batching, _to_round_order, stages_of_mesh
from xlaopt.transforms import cast_once
from xlaopt.transforms.layers_apart import Layers, apart, evaluate_by_layer, is_layers, scanned_inputs

# (tail_params, y_mb, tail_args_mb, extra) -> this micro-batch's share of the loss, and of each
# metric ({name: scalar}, reported, not differentiated)
Tail = Callable


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _no_cotangent(x):
    return np.zeros(np.shape(x), jax.dtypes.float0) if not _inexact(x) else jnp.zeros_like(x)


def pipeline_loss_1f1b(layer_fn: Callable, params_L, carry, args: tuple, tail: Tail, tail_params, tail_args,
                       extra, microbatches: int, inner: Callable, gather: Callable | None = None,
                       virtual_stages: int = 1, like_weights: Callable | None = None, scatter=None):
    """(loss, metrics) of `tail` after the layers of `params_L` ([L, ...] leaves) over `carry`,
    summed over micro-batches, with the loss's gradients by the 1F1B schedule over the stages.

    `tail(tail_params, y, tail_args_m, extra)` is one micro-batch's share of the loss and of each
    metric (the sum of the shares is the loss, or the metric). `args` and `tail_args` lead with
    the rows like `carry`; `tail_args` and `extra` are data (no gradient flows into them).
    `inner`, `gather` and `virtual_stages` as in `pipeline_layers` (over virtual stages:
    interleaved 1F1B). `like_weights(tree)`, where given, lays out a tree shaped like a stage's
    weights as they are laid out (`gather`'s layout where given): each tick's weight gradients
    before they are accumulated. Told nothing, XLA's partitioner computed the attention output
    projection's whole gradient and all-reduced it over `tensor` (calibration row R12, with the
    accumulators' scatter-add). `scatter`, where given (ZeRO-1, `grad_sums.gradient_scatter`), is a
    tree shaped like `params_L` of each weight's split over data, the share of its gradient each
    data replica keeps, or None where it is summed whole. One stage: `inner` then `tail` on the whole
    batch, the same numbers."""
    stages = stages_of_mesh()
    if stages == 1:
        return tail(tail_params, inner(layer_fn, params_L, carry, args), tail_args, extra)
    schedule = PipelineSchedule(stages, microbatches or stages, "1f1b", virtual_stages)
    schedule.check_layers(jax.tree.leaves(params_L)[0].shape[0])
    for leaf in jax.tree.leaves(carry):
        if not _inexact(leaf):
            raise ValueError(f"1F1B pipeline: the layer stack's carry must be floating point, got {leaf.dtype}")
    data, seq, row_axes, split, merge = _micro_batching((carry, tail_args), args, schedule.microbatches, stages)
    manual = tuple(a for a in (STAGE, data, seq) if a)
    scatter = scatter if data == DATA else None  # scattered over data where the loop runs manual over it
    run = _loop(layer_fn, tail, inner, gather, like_weights, schedule, split, data, seq, scatter)
    d_params_spec = PartitionSpec(STAGE) if scatter is None else share_specs(scatter, STAGE)

    def step(params_L, tail_params, carry, args, tail_args, extra):
        inputs = PartitionSpec(data, seq)
        out_rows = PartitionSpec(data, STAGE, None, seq)
        with manual_over(manual_axes() + manual), rows_split_over(row_axes):
            loss, grads = jax.shard_map(
                run, in_specs=(PartitionSpec(STAGE), PartitionSpec(), inputs, inputs, inputs, PartitionSpec()),
                out_specs=((PartitionSpec(), PartitionSpec()),
                           (d_params_spec, PartitionSpec(), out_rows, out_rows)),
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


def _split_on_weights(fwd: Callable, params_k, x, a_float, a_rest):
    """`fwd(params_k, x, a_float, a_rest)` and its vjp (differentiated in the first three) split
    by JAX's partial evaluation into what depends on the weights alone and what on the
    micro-batch: (once_of, forward_of, backward_of, by_layer).

    `once_of(params_k) -> (once, held)` is the weights' part, run once a step: `once` the vjp
    residuals made of the weights alone (their casts, their transposes), `held` what the forward
    reads of them (the weights cast to the compute dtype, or quantized to fp8 with their scales).
    `forward_of(held, x, a_float, a_rest) -> (y, kept)` is the rest, run every micro-batch: the
    output and the residuals that depend on the micro-batch. `backward_of(once, kept, dy)` is the
    vjp. `by_layer = (once, held)` says of each of their lists which leaves the chunk's layer scan
    scans: given as `layers_apart.Layers`, the forward and backward read them a layer at a time
    from buffers of their own, the scan unrolled (`layers_apart.evaluate_by_layer`), and what the
    scan would stack (the weights' gradients, the residuals kept) comes back as `Layers`. Each
    tick's forward sliced its chunk of the fp32 weights and cast them again before the split
    (with `_stacked_once`, 1.4 s of calibration row R13's 22.5 s step)."""
    def run(p, x, af, ar):
        return jax.vjp(lambda p, x, af: fwd(p, x, af, ar), p, x, af)

    n_weights = len(jax.tree.leaves(params_k))
    closed, (y_shape, vjp_shape) = jax.make_jaxpr(run, return_shape=True)(params_k, x, a_float, a_rest)
    n_y, treedef = len(jax.tree.leaves(y_shape)), jax.tree.structure(vjp_shape)
    unknown_in = [i >= n_weights for i in range(len(closed.in_avals))]
    known, unknown, out_unknown, _ = partial_eval_jaxpr_nounits(closed, unknown_in, instantiate=False)
    y_unknown, per_microbatch = out_unknown[:n_y], out_unknown[n_y:]
    assert all(y_unknown), "the layers' output does not depend on their input"
    n_once = sum(not u for u in per_microbatch)
    n_held = len(known.out_avals) - n_once
    known_fn = jaxpr_as_fun(known)

    def once_of(params):
        outs = known_fn(*jax.tree.leaves(params))
        return list(outs[:n_once]), list(outs[n_once:])

    def forward_of(held, x, af, ar):
        outs = evaluate_by_layer(unknown, *held, *jax.tree.leaves((x, af, ar)))
        return jax.tree.unflatten(jax.tree.structure(y_shape), outs[:n_y]), list(outs[n_y:])

    def rebuild(once, kept, dy):
        it_once, it_kept = iter(once), iter(kept)
        vjp = jax.tree.unflatten(treedef, [next(it_kept) if v else next(it_once) for v in per_microbatch])
        return vjp(dy)

    like = lambda avals: [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]  # noqa: E731
    kept_avals = [a for a, v in zip(closed.out_avals[n_y:], per_microbatch) if v]
    backward, d_shape = jax.make_jaxpr(rebuild, return_shape=True)(
        like(known.out_avals[:n_once]), like(kept_avals), y_shape)

    def backward_of(once, kept, dy):
        outs = evaluate_by_layer(backward, *once, *kept, *jax.tree.leaves(dy))
        return jax.tree.unflatten(jax.tree.structure(d_shape), outs)

    by_layer = (scanned_inputs(backward)[:n_once], scanned_inputs(unknown)[:n_held])
    return once_of, forward_of, backward_of, by_layer


def _narrowed(fwd: Callable, params_k, x, a_float, a_rest):
    """`narrow(tree)`: each weight of a tree shaped like `params_k` that `fwd` reads once, through a
    cast (to the compute dtype, for a projection; `xlaopt.transforms.cast_once`), cast so already.
    The forward and backward then run on the cast weights, and each tick's weight gradient leaves
    the backward in that dtype, to be added to the fp32 accumulator: the same numbers (the cast's
    transpose is exact), where the backward wrote every gradient in fp32 first (calibration row
    R13: 0.85 s of its step)."""
    closed = jax.make_jaxpr(fwd)(params_k, x, a_float, a_rest)
    dtypes = jax.tree.leaves(cast_once.cast_dtypes(closed.jaxpr, params_k), is_leaf=lambda d: d is None)

    def narrow(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [w.astype(d) if d is not None else w for w, d in zip(leaves, dtypes)])

    return narrow


def _stacked_once(once_of: Callable, chunks, chunk: Callable, V: int):
    """(once, held) of `_split_on_weights` for each of the V chunks, stacked [V, ...]. `held` is
    computed apart from `once` (behind an optimization barrier, so XLA does not merge the two),
    though both hold the same casts: the forward's GEMMs and the backward's read the same fp8
    weights in different layouts (the contracted dimension innermost), and one shared stack made
    XLA transpose all V chunks of it inside every tick (calibration row R13: 0.85 s). A stage
    keeps the casts twice, as Transformer Engine keeps an fp8 weight and its transpose."""
    def stacked(lists):
        return [jnp.stack(leaves) for leaves in zip(*lists)]

    apart = jax.lax.optimization_barrier(chunks)
    return (stacked([once_of(chunk(chunks, v))[0] for v in range(V)]),
            stacked([once_of(chunk(apart, v))[1] for v in range(V)]))


def _chunks_apart(stacks: list, scanned: list[bool], V: int) -> list[list]:
    """[V, k, ...] stacks (one chunk of k layers each along the first dimension) as each chunk's
    list, a stack its layer scan scans (`scanned`) as `Layers` (split once a step, here, so each
    layer's weights are a buffer of its own), any other as the chunk's slice.

    Over virtual stages only, whose chunks are a few layers each (R13: 2). Without them a chunk
    is a stage's whole stack, and unrolled it priced slower: held-out row N03 (16 layers a stage)
    8.47 -> 9.32 s, its sequence-parallel waits exposed as R13's are, and each layer's gradient,
    added at a constant index, priced by the simulator as its whole accumulator
    (`hlo_costs._fusion_access` reads a static slice as its whole buffer); N05's compile (20
    layers a stage) was 321 s already. The scan over the stage's stack reads each layer by one
    dynamic slice there (the chunk's slice of a [1, k, ...] stack is the whole buffer)."""
    return [[apart(s[v]) if by_layer and V > 1 else s[v] for s, by_layer in zip(stacks, scanned, strict=True)]
            for v in range(V)]


def _chunk_switch(ok, v, chunk_fn: Callable, V: int, *operands):
    """`chunk_fn(v)(*operands)` where `ok`, else its results' shapes in zeros: one `lax.switch`
    whose branch 0 runs nothing (as a `lax.cond`'s false branch; the simulator's rule for 1F1B's
    branches, `PipelineSchedule.branches_taken`, picks branch 0 or the busiest other) and branch
    c + 1 chunk c (over virtual stages on its own layers' buffers, `_chunks_apart`)."""
    branches = [_zeros_of(chunk_fn(0), *operands)] + [chunk_fn(c) for c in range(V)]
    return jax.lax.switch(jnp.where(ok, v + 1, 0), branches, *operands)


def _accumulated(d_chunks, dp, v, like_weights: Callable | None):
    """The accumulators [V, k, ...] with chunk v's weight gradients `dp` added, layer by layer
    where they come as `Layers` (each layer's written where it accumulates, never stacked first:
    calibration row R13, 0.35 s of its step), laid out as the weights are (`like_weights`, one
    layer at a time); without `Layers` (no virtual stages, `_chunks_apart`), the chunk at once."""
    if not any(map(is_layers, jax.tree.leaves(dp, is_leaf=is_layers))):
        dp = like_weights(dp) if like_weights is not None else dp
        return jax.tree.map(lambda d, g: _add_at(d, v, g), d_chunks, dp)

    def layers(g):
        return g if is_layers(g) else apart(g)

    dp = jax.tree.map(layers, dp, is_leaf=is_layers)
    k = len(jax.tree.leaves(dp, is_leaf=is_layers)[0])
    for i in range(k):
        g_i = jax.tree.map(lambda g, i=i: g[i][None], dp, is_leaf=is_layers)
        g_i = like_weights(g_i) if like_weights is not None else g_i
        d_chunks = jax.tree.map(lambda d, g, i=i: _add_at(d, (v, i), g[0]), d_chunks, g_i)
    return d_chunks


def _ring(kept_shapes: list, slots: int) -> list:
    """Zero buffers, [slots, ...] each, for a forward's residuals (shapes of them, or of `Layers`,
    which the ring holds stacked: [slots, k, ...])."""
    stacked = [jax.ShapeDtypeStruct((len(a), *a[0].shape), a[0].dtype) if is_layers(a) else a for a in kept_shapes]
    return [jnp.zeros((slots, *a.shape), a.dtype) for a in stacked]


def _ring_write(ring: list, kept: list, slot) -> list:
    """The ring with a forward's residuals written into `slot`, each in place, a layer at a time
    where it comes as `Layers` (the ring holds it stacked, [slots, k, ...])."""
    def write(r, k):
        if not is_layers(k):
            return jax.lax.dynamic_update_index_in_dim(r, k, slot, 0)
        for i, x in enumerate(k):
            r = jax.lax.dynamic_update_slice(r, x[None, None], (slot, i) + (0,) * x.ndim)
        return r

    return [write(r, k) for r, k in zip(ring, kept, strict=True)]


def _ring_read(ring: list, slot, like: list) -> list:
    """The residuals in `slot` of the ring, as `Layers` where the forward gave them so (`like`)."""
    def read(r, k):
        if not is_layers(k):
            return r[slot]
        zeros = (0,) * (r.ndim - 2)
        return Layers(jax.lax.dynamic_slice(r, (slot, i, *zeros), (1, 1, *r.shape[2:]))[0, 0] for i in range(len(k)))

    return [read(r, k) for r, k in zip(ring, like, strict=True)]


def _zeros_of(fn: Callable, *operands) -> Callable:
    """A `lax.cond` branch that runs nothing: `fn`'s results' shapes, zero."""
    shapes = jax.eval_shape(fn, *operands)
    return lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _in_chunks(params_k, stages: int, V: int):
    """(own, chunk, to_round, to_contiguous): this stage's weights as [V, k / V, ...] chunks in its
    own order ([1, k, ...] without virtual stages), `chunk(tree, v)` the v-th of any tree stacked
    so, `to_round(tree)` such a tree in round order (chunk vP + p is stage p's v-th,
    `pipeline._to_round_order`), and the transpose that takes gradients of the chunks in round
    order back to the stage's contiguous layers. What crosses the stages forward is what each
    stage makes of its own chunks once a step (`_stacked_once`: the casts to bf16 or fp8), not
    the fp32 weights (calibration row R13 sent 2 x 18 GB a device over InfiniBand, 2.7 s)."""
    def own_of(w):
        return jax.tree.map(lambda x: x.reshape(V, x.shape[0] // V, *x.shape[1:]), w)

    def to_round(tree):
        return jax.tree.map(lambda x: _to_round_order(x, stages, V), tree) if V > 1 else tree

    def chunk(tree, v):  # without virtual stages a static index: the one chunk is the stage's weights
        return jax.tree.map(lambda x: x[v if V > 1 else 0], tree)

    def to_contiguous(tree):  # in the tree's own dtypes and shapes (a replica's share under ZeRO-1)
        like = jax.tree.map(lambda t: jax.ShapeDtypeStruct((t.shape[0] * t.shape[1], *t.shape[2:]), t.dtype), tree)
        return jax.linear_transpose(lambda w: to_round(own_of(w)), like)(tree)[0]

    return own_of(params_k), chunk, to_round, to_contiguous


def _add_at(d, i, g):
    """`d[i] += g` (`i` an index, or a tuple of them) as a scatter-add of the one index, which
    XLA's GPU compile fuses into one in-place update: the slice read, added and written back. As
    a dynamic slice and a dynamic update of the same buffer it copied the slice out first, in a
    fusion of its own (calibration row R13: 1.2 s of its step). The accumulators start from the
    weights times zero (`_accumulators`), or the partitioner loses their tensor split at the
    scatter."""
    return d.at[i].add(g.astype(d.dtype), indices_are_sorted=True, unique_indices=True)


def _accumulators(chunks):
    """Zero gradient accumulators shaped and split like `chunks`, in the dtype the step accumulates
    in (`grad_sums.accumulated_dtype`): `0 * w`, not a fresh zero, so that XLA's partitioner splits
    each over the tensor ranks as it splits the weight. From `zeros_like`, it lost the split at the
    scatter-add and all-reduced the gradients over `tensor` at every tick (calibration row N03:
    3.9x the tensor bytes). XLA keeps the product (x * 0 is not 0 for an infinite or NaN x); it
    costs one pass over the weights a step."""
    return _as_accumulated(jax.tree.map(lambda w: w * jnp.zeros((), w.dtype), chunks))


def _weights_summed(d_chunks, summed: tuple[str, ...], to_contiguous: Callable, scatter):
    """The weights' gradients of the ticks (round order, as accumulated) summed over the manual axes that
    split the rows as the step sums gradients (`grad_sums.summed_gradients`: crossing them in bf16
    where it reduces them so, as Megatron-Core does), then in the stage's contiguous order and
    their own dtype. Summed first, so that the reorder across the stages sends what crossed data:
    half the bytes in bf16 (calibration row R13 reordered 2 x 17 GB of fp32 gradients a device
    over InfiniBand). Under ZeRO-1 (`scatter`, each weight's split over data) reduce-scattered
    over data instead, each replica keeping the share its moments update
    (`grad_sums.scattered_share`), so that the reorder sends that share alone (R13: 0.43 s less
    exposed)."""
    if not summed:
        return to_contiguous(d_chunks)
    if scatter is None:
        return _in_dtypes_of(to_contiguous(summed_gradients(d_chunks, summed)), d_chunks)

    def share(d, spec):  # the chunk layout [V, k, ...] has one dimension more than the weight's [L, ...]
        return summed_gradients(d, summed) if spec is None else scattered_share(d, spec, 1, summed, (STAGE,))

    tree = jax.tree.map(share, d_chunks, scatter)
    return _in_dtypes_of(to_contiguous(tree), d_chunks)


def _in_dtypes_of(tree, like):
    return jax.tree.map(lambda t, d: t.astype(d.dtype), tree, like)


def _as_accumulated(tree):
    """`tree` (gradients) in the dtype the step accumulates them in (`grad_sums.accumulated_dtype`)."""
    return jax.tree.map(lambda d: d.astype(accumulated_dtype(d)), tree)


def _reduced(acc, summed: tuple[str, ...], params):
    """(loss, gradients) of the device from the tick loop's sums (the weights' summed already,
    `_weights_summed`): the loss and the tail's summed over the manual axes that split the rows and
    the stages, the tail's as the weights'. Only stage 0 wrote the carry's gradient and every stage
    its share of the args': the sum over `stage` hands each its micro-batches' rows, as GPipe's
    loop hands its output. The weights' and the tail's in the dtypes of `params` = (the weights,
    the tail's), for the optimizer, where they were accumulated narrower (`grad_accumulate_dtype`)."""
    d_params, d_tail, d_carry, d_args, reported = acc
    scatter = lambda d: jax.lax.psum_scatter(d, STAGE, scatter_dimension=0, tiled=True)[None]  # noqa: E731
    if summed:  # crossing data as the weights' do (only the last stage's are not zero)
        d_tail = _in_dtypes_of(summed_gradients(d_tail, (STAGE, *summed)), d_tail)
    else:
        d_tail = jax.lax.psum(d_tail, STAGE)
    return (jax.lax.psum(reported, (STAGE, *summed)),
            (*_in_dtypes_of((d_params, d_tail), params), jax.tree.map(scatter, d_carry), jax.tree.map(scatter, d_args)))


def _loop(layer_fn, tail, inner, gather, like_weights, schedule: PipelineSchedule, split, data, seq, scatter):
    """The shard_map's body: (loss, (weight, tail, carry and float args' gradients)) of this device."""
    P, V, units = schedule.stages, schedule.virtual_stages, schedule.virtual_stages * schedule.microbatches
    slots = schedule.saved_ticks
    summed = tuple(a for a in (data, seq) if a)
    # Without virtual stages the last stage's result goes nowhere; with them, round after round.
    up = [(p, (p + 1) % P) for p in range(P - (V == 1))]
    down = [(b, a) for a, b in up]

    def local(params_k, tail_params, carry, args, tail_args, extra):
        own, chunk, to_round, to_contiguous = _in_chunks(gather(params_k) if gather is not None else params_k, P, V)
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
        narrowed = _narrowed(fwd, chunk(own, 0), x0, *parts(take(args_M, 0)))(own)
        once_of, forward_of, backward_of, (once_apart, held_apart) = _split_on_weights(
            fwd, chunk(narrowed, 0), x0, *parts(take(args_M, 0)))
        once, held = to_round(_stacked_once(once_of, narrowed, chunk, V))
        once, held = _chunks_apart(once, once_apart, V), _chunks_apart(held, held_apart, V)

        def forward_in(v):  # chunk v's forward
            return lambda x, af, ar: forward_of(held[v], x, af, ar)

        def tail_grad(y, ta):
            (loss, metrics), (d_tail, dy) = jax.value_and_grad(tail, argnums=(0, 1), has_aux=True)(
                tail_params, y, ta, extra)
            as_f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
            return (as_f32(loss), jax.tree.map(as_f32, metrics)), _as_accumulated(d_tail), dy

        def backward_in(v):  # chunk v's backward, its residuals read out of the ring
            return lambda ring, b_slot, dy: backward_of(once[v], _ring_read(ring, b_slot, kept_shapes), dy)

        def tick(state, t):
            handed_y, handed_dy, ring, (d_chunks, d_tail, d_carry, d_args, reported) = state
            f, b = t - stage, t - schedule.backward_lag(stage)
            f_ok, b_ok = (f >= 0) & (f < units), (b >= 0) & (b < units)
            f, b = jnp.clip(f, 0, units - 1), jnp.clip(b, 0, units - 1)
            (fm, fv), (bm, bv, b_slot) = schedule.unit(f), schedule.backward_unit(b)
            x = jax.tree.map(lambda own, h: jnp.where(first & (fv == 0), own, h), take(carry_M, fm), handed_y)
            af, ar = parts(take(args_M, fm))
            with jax.named_scope(BRANCH_SCOPE.format("forward")):
                y, kept = _chunk_switch(f_ok, fv, forward_in, V, x, af, ar)
            slot = jnp.where(f_ok, f % slots, slots)  # the spare slot past the ring takes a bubble tick's
            ring = _ring_write(ring, kept, slot)
            ta = take(tail_args_M, fm)
            with jax.named_scope(BRANCH_SCOPE.format("tail")):
                l, dt, dy_tail = jax.lax.cond(last & f_ok & (fv == V - 1), tail_grad, _zeros_of(tail_grad, y, ta),
                                              y, ta)
            dy = jax.tree.map(lambda own, h: jnp.where(last & (bv == V - 1), own, h), dy_tail, handed_dy)
            with jax.named_scope(BRANCH_SCOPE.format("backward")):
                dp, dx, da = _chunk_switch(b_ok, bv, backward_in, V, ring, b_slot % slots, dy)
            d_chunks = _accumulated(d_chunks, dp, bv if V > 1 else 0, like_weights)
            d_carry = jax.tree.map(lambda o, n: o.at[bm].add(jnp.where(first & b_ok & (bv == 0), n, 0)), d_carry, dx)
            d_args = [o.at[bm].add(jnp.where(b_ok, n, 0)) for o, n in zip(d_args, da)]
            sent_y = jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE, up), y)
            sent_dy = jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE, down), dx)
            acc = (d_chunks, jax.tree.map(jnp.add, d_tail, dt), d_carry, d_args, jax.tree.map(jnp.add, reported, l))
            return (sent_y, sent_dy, ring, acc), None

        kept_shapes = jax.eval_shape(forward_in(0), x0, *parts(take(args_M, 0)))[1]
        ring = _ring(kept_shapes, slots + 1)
        acc = (_accumulators(own), _as_accumulated(_zeros(tail_params)), _zeros(carry_M), _zeros(parts(args_M)[0]),
               _zeros_of(tail_grad, x0, take(tail_args_M, 0))()[0])
        (_, _, _, acc), _ = jax.lax.scan(tick, (_zeros(x0), _zeros(x0), ring, acc), jnp.arange(schedule.ticks))
        d_weights = _weights_summed(acc[0], summed, to_contiguous, scatter)
        return _reduced((d_weights, *acc[1:]), summed, (params_k, tail_params))

    return local

"""The micro-batch loop: a step's gradients accumulated over slices of its rows, one after another.

`accumulate` leaves the layout to XLA's partitioner. `accumulate_manual` runs the loop in a
shard_map manual over the axes that split the rows (data) and, where context parallelism splits
the sequences, over that axis too: each rank sums its own tokens' gradients over the loop and they
are reduced once, after the last micro-batch, as Megatron-LM reduces over data x context. Left to
the partitioner, the weight gradients were all-reduced inside each layer's backward at every
micro-batch (calibration row R11, data=4 x context=2: 32 micro-batches a step). Under ZeRO-1
they are reduce-scattered over data instead, each replica keeping the share its moments update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from xlaopt.models.grad_sums import reduced_over, scattered_share, share_specs
from xlaopt.models.layers import manual_over, rows_split_over, sequence_split_over
from xlaopt.transforms import weights_once


def summed_in(dtype: str, target: str):
    """`sum(g, axes, scatter_dim=None)`: each gradient summed over `axes` (`grad_sums.reduced_over`:
    reduce-scattered over data onto `scatter_dim` where given), crossing them in `dtype`, and
    returned in `dtype` (a 1F1B pipeline reorders the sum before widening it). XLA:CPU widens a bf16
    all-reduce to f32 anyway (its AllReducePromotion), and on jax 0.10.2 aborts the process doing so
    inside a shard_map manual over some of the mesh's axes ("Invalid binary instruction opcode
    copy"): on the CPU the rounded gradients are summed in f32, as that promotion would sum them,
    and the sum rounded."""
    if dtype == "float32":
        return reduced_over
    if target == "cpu":
        return lambda g, axes, dim=None: reduced_over(g.astype(dtype).astype(jnp.float32), axes, dim).astype(dtype)
    return lambda g, axes, dim=None: reduced_over(g.astype(dtype), axes, dim)


def reduced_in(dtype: str, target: str):
    """`reduce(g, axes)` for `accumulate_manual`: `summed_in`'s sum returned in the gradient's own dtype."""
    summed = summed_in(dtype, target)
    return lambda g, axes, dim=None: summed(g, axes, dim).astype(g.dtype)


def accumulate(grad_fn, micro_batches: int, axes: dict[str, tuple], hold=None, grad_dtype=None):
    """`grad_fn` over `micro_batches` slices of the batch's rows, one after another (peak
    activation memory of one slice), returning the mean loss, metrics and gradients. Each
    slice's loss is its own per-token mean, so the result weighs slices equally. With `hold`
    (`step._holding`), what `grad_fn` computes from the weights alone runs once, before the loop
    (`xlaopt.transforms.weights_once`), and `hold(values)` places what the loop reads of it. The
    gradients are summed in `grad_dtype` where given (`grad_accumulate_dtype`), returned in their
    own."""
    if micro_batches == 1:
        return grad_fn

    def accumulated(params, batch, key):
        slices = {name: _micro_batches(x, axes[name].index("batch"), micro_batches) for name, x in batch.items()}
        inputs = lambda i: ({name: x[i] for name, x in slices.items()}, jax.random.fold_in(key, i))  # noqa: E731
        return _summed(_each_micro_batch(grad_fn, params, inputs, hold), micro_batches, grad_dtype)

    return accumulated


def accumulate_manual(grad_fn, draws, micro_batches: int, rows: dict[str, int], axis: str, other_row_axes: tuple,
                      reduce, hold=None, sequence: tuple[str, dict[str, int]] | None = None, grad_dtype=None,
                      scatter=None):
    """`accumulate` in a shard_map manual over `axis` (one that splits the rows and no parameter):
    each rank sums its own rows' gradients over the micro-batches and they are reduced over `axis`
    once, after the last (by `reduce(g, axes)`: `reduced_in`'s psum). Left to the
    partitioner, every micro-batch's gradients were all-reduced over it inside that micro-batch's
    backward, `micro_batches` times a step. The draws are made before, on the whole batch, as one
    device makes them; `rows`: each batch array's and draw's row dimension. `sequence`, where
    given, is (the axis that splits the sequences, each array's sequence dimension): manual over
    it too, each rank runs its chunk of every row (`layers.sequence_split_over`). `scatter(params)`,
    where given (ZeRO-1), is a tree shaped like the gradients of each one's split over data
    (`sharding.data_scatter_specs`): reduce-scattered onto it (`grad_sums.scattered_share`), each
    replica keeping the share its moments update, where None leaves it whole."""
    seq_axis, seq_dims = sequence if sequence else (None, {})
    manual = (axis, seq_axis) if seq_axis else (axis,)

    def spec(name):
        dims = [None] * (max(rows[name], seq_dims.get(name, -1)) + 2)  # the micro-batch dimension leads
        dims[rows[name] + 1] = axis
        if name in seq_dims:
            dims[seq_dims[name] + 1] = seq_axis
        return PartitionSpec(*dims)

    def accumulated(params, batch, key):
        slices = {name: _micro_batches(x, rows[name], micro_batches) for name, x in batch.items()}
        drawn = jax.vmap(lambda one, i: draws(one, jax.random.fold_in(key, i)))(slices, jnp.arange(micro_batches))

        def local(params, drawn, key):
            # Each rank's loss is its tokens' share of the global mean (`layers.token_mean`).
            with manual_over(manual), rows_split_over(other_row_axes), sequence_split_over(seq_axis):
                inputs = lambda i: ({n: x[i] for n, x in drawn.items()}, jax.random.fold_in(key, i))  # noqa: E731
                loss, metrics, grads = _summed(_each_micro_batch(grad_fn, params, inputs, hold),
                                               micro_batches, grad_dtype)
            return (*jax.lax.psum((loss, metrics), manual), _reduced(grads, shares, reduce, manual))

        shares = scatter(params) if scatter is not None else None
        out_specs = PartitionSpec() if shares is None else (PartitionSpec(), PartitionSpec(), share_specs(shares))
        return jax.shard_map(local, in_specs=(PartitionSpec(), {n: spec(n) for n in drawn}, PartitionSpec()),
                             out_specs=out_specs, axis_names=set(manual), check_vma=False)(params, drawn, key)

    return accumulated


def _reduced(grads, shares, reduce, manual: tuple[str, ...]):
    """`grads` reduced over the manual axes by `reduce`, each reduce-scattered onto its ZeRO-1 split
    where `shares` gives one."""
    if shares is None:
        return jax.tree.map(lambda g: reduce(g, manual), grads)
    return jax.tree.map(lambda g, s: reduce(g, manual) if s is None else scattered_share(g, s, 0, manual, manual, reduce),
                        grads, shares)


def _each_micro_batch(grad_fn, params, inputs, hold):
    """i -> grad_fn(params, *inputs(i)); with `hold`, the part of it that reads `params` alone
    computed here, once (`weights_once.split`), and placed by `hold`."""
    if hold is None:
        return lambda i: grad_fn(params, *inputs(i))
    once, each = weights_once.split(grad_fn, params, *jax.eval_shape(inputs, 0))
    held = hold(once(params))
    return lambda i: each(held, params, *inputs(i))


def _micro_batches(x, axis: int, micro_batches: int):
    """[..., rows, ...] -> [micro_batches, ..., rows / micro_batches, ...]. Micro-batch i takes
    every `micro_batches`-th row, so each device's rows (a contiguous block when the rows are
    sharded) spread over all micro-batches and every micro-batch keeps the batch's sharding;
    leading slices would put micro-batch i on 1/m of the devices."""
    x = jnp.moveaxis(x, axis, 0)
    x = jnp.swapaxes(x.reshape((x.shape[0] // micro_batches, micro_batches) + x.shape[1:]), 0, 1)
    return jnp.moveaxis(x, 1, axis + 1)


def _summed(one, micro_batches: int, grad_dtype=None):
    """The mean over i < micro_batches of `one(i)` = (loss, metrics, gradients), one i after
    another; the gradients summed in `grad_dtype` where given, the mean taken in their own."""
    loss, metrics, grads = jax.eval_shape(one, 0)
    summed_as = (loss, metrics, jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, grad_dtype or g.dtype), grads))

    def body(total, i):
        return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, one(i)), None

    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), summed_as)
    total, _ = jax.lax.scan(body, zeros, jnp.arange(micro_batches))
    return jax.tree.map(lambda t, a: t.astype(a.dtype) / micro_batches, total, (loss, metrics, grads))

"""Tensor parallel's output matmuls as collective matmuls: the reduction over the tensor ranks
done as a ring of `ppermute`s, each step beside a partial matmul, so the transfer of one chunk
hides behind the matmul of the next.

Under tensor parallelism the attention output and MLP down projections contract over a
dimension the tensor ranks split (heads, mlp): each rank's matmul is a partial sum of the whole
output, and XLA all-reduces it after the matmul, with nothing left to overlap. Here
(`models.layers.reduce_matmul`, inside a `shard_map` over the tensor axis) the output's sequence
is cut into one chunk per rank and reduce-scattered around the ring while it is computed: at
step s rank r computes its partial sum of chunk (r - s - 1) mod n, adds the running sum its left
neighbour just sent for that chunk and passes it on; after n - 1 steps rank r holds the full sum
of chunk r. The output leaves the shard_map split along its sequence, and XLA gathers it where
the layout wants it whole (the residual stream). Bidirectional: each chunk is split
in two halves that go round the ring in opposite directions, so each step sends half the bytes
each way over both directions of every link. JAX differentiates the ring: the backward pass is
the reverse ring, again interleaved with the partial matmuls of the gradients.

Written with `shard_map` and `ppermute`, so it does not depend on XLA's windowed einsum (which
fails the HLO verifier for large shards on jax 0.10.2, jax#39200). Where the sequence does not
split into the ranks' chunks the matmul runs as before.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from xlaopt.models.layers import reduce_matmul_through
from xlaopt.transforms import GradTransform


def _chunks(r, n: int, bidirectional: bool):
    """Each step's (chunk index, first row within the chunk, rows, direction) per ring: at step s
    rank r works on chunk (r - s - 1) mod n of the right-going ring and (r + s + 1) mod n of the
    left-going one, so that after n - 1 steps it holds chunk r of both."""
    right = [((r - s - 1) % n, "right") for s in range(n)]
    if not bidirectional:
        return [right]
    return [right, [((r + s + 1) % n, "left") for s in range(n)]]


def _halves(chunk: int, bidirectional: bool):
    return [(0, chunk)] if not bidirectional else [(0, chunk // 2), (chunk // 2, chunk - chunk // 2)]


def _shifts(n: int):
    return {"right": [(i, (i + 1) % n) for i in range(n)], "left": [(i, (i - 1) % n) for i in range(n)]}


def _ring_forward(x, w, equation: str, axis: str, n: int, bidirectional: bool):
    r, chunk = jax.lax.axis_index(axis), x.shape[1] // n
    shifts = _shifts(n)
    outs = []
    for steps, (lo, size) in zip(_chunks(r, n, bidirectional), _halves(chunk, bidirectional)):
        rows = lambda c, lo=lo, size=size: jax.lax.dynamic_slice_in_dim(x, c * chunk + lo, size, axis=1)  # noqa: E731
        acc = jnp.einsum(equation, rows(steps[0][0]), w)
        for c, direction in steps[1:]:
            acc = jax.lax.ppermute(acc, axis, shifts[direction]) + jnp.einsum(equation, rows(c), w)
        outs.append(acc)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _ring(x, w, equation: str, axis: str, n: int, bidirectional: bool):
    """This rank's partial products of `x` and `w` reduce-scattered over `axis` along the output's
    dimension 1 (its sequence) in a ring of `n`: this rank's chunk of the sum."""
    return _ring_forward(x, w, equation, axis, n, bidirectional)


def _ring_fwd(x, w, equation, axis, n, bidirectional):
    return _ring_forward(x, w, equation, axis, n, bidirectional), (x, w)


def _ring_bwd(equation, axis, n, bidirectional, res, ct):
    """The reverse ring, written out (autodiff's transpose of each step's slice would add a
    zero-filled copy of the whole input per step): the output chunk's gradient travels back round
    the ring and at each step gives one chunk of x's gradient, written in place, and a share of
    w's. The next step's transfer is issued before this step's matmuls, which do not need it."""
    x, w = res
    r, chunk = jax.lax.axis_index(axis), x.shape[1] // n
    back = {"right": "left", "left": "right"}
    shifts = _shifts(n)
    dx, dw = jnp.zeros_like(x), jnp.zeros_like(w)
    offset = 0
    for steps, (lo, size) in zip(_chunks(r, n, bidirectional), _halves(chunk, bidirectional)):
        g = jax.lax.slice_in_dim(ct, offset, offset + size, axis=1)
        offset += size
        for s in reversed(range(n)):
            c, direction = steps[s]
            g_next = jax.lax.ppermute(g, axis, shifts[back[direction]]) if s else None
            rows = jax.lax.dynamic_slice_in_dim(x, c * chunk + lo, size, axis=1)
            _, vjp = jax.vjp(lambda xc, wc: jnp.einsum(equation, xc, wc), rows, w)
            drows, dwc = vjp(g)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, drows, c * chunk + lo, axis=1)
            dw = dw + dwc
            g = g_next
    return dx, dw


_ring.defvjp(_ring_fwd, _ring_bwd)


@dataclasses.dataclass(frozen=True)
class CollectiveMatmulTransform(GradTransform):
    name: ClassVar[str] = "collective-matmul"
    axis: str  # the mesh axis the contraction is split over (tensor)
    size: int  # its size: the ring's length
    bidirectional: bool = True

    def fits(self, x: jax.Array) -> bool:
        chunk, rem = divmod(x.shape[1], self.size)
        return rem == 0 and chunk >= (2 if self.bidirectional else 1)

    def matmul(self, equation: str, x, w, x_split: int, w_split: int):
        """`jnp.einsum(equation, x, w)` contracting dimension `x_split` of x with `w_split` of w,
        both split over `self.axis`; the output whole over it."""
        if not self.fits(x):
            return jnp.einsum(equation, x, w)
        spec = lambda ndim, dim: PartitionSpec(*[self.axis if i == dim else None for i in range(ndim)])  # noqa: E731
        ring = functools.partial(_ring, equation=equation, axis=self.axis, n=self.size,
                                 bidirectional=self.bidirectional)
        return jax.shard_map(ring, in_specs=(spec(x.ndim, x_split), spec(w.ndim, w_split)),
                             out_specs=spec(len(equation.split("->")[1]), 1), axis_names={self.axis})(x, w)

    def apply(self, grad_fn: Callable) -> Callable:
        def wrapped(params, batch, key):
            with reduce_matmul_through(self.matmul):
                return grad_fn(params, batch, key)
        return wrapped

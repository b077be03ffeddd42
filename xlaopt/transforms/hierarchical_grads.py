"""Gradient reduction in two levels, written out by hand: reduce-scatter inside each node, all-reduce
of the shards across the nodes, all-gather inside the node again.

XLA's partitioner reduces a data-parallel gradient with one all-reduce over every data rank, so
each byte of it crosses the network (tests/test_grad_sync.py). Here the gradient function runs
in a `shard_map` over the data axis: every device differentiates its own rows' share of the loss
(`models.layers.token_mean` makes the shares add up to the one-device loss) and the gradients
are summed over the data axis in the three steps above, where the middle one, the only one on
the network, carries 1/(data ranks per node) of the bytes. Each layer of a layer stack is
reduced inside the backward loop as soon as its backward is done (`models.stack`'s parameter
hook), the rest after the backward; the loss and metrics are summed flat (scalars).

The other mesh axes stay XLA's: the gradient function inside is still partitioned over tensor,
fsdp and context by the layout. A parameter is scattered along a dimension no other axis splits
(`scatter_dims`); one without such a dimension is all-reduced whole.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ClassVar

import jax
from jax.sharding import PartitionSpec

from xlaopt.models.layers import manual_over, rows_split_over
from xlaopt.models.stack import layer_params_through
from xlaopt.transforms import GradTransform

WHOLE = -1  # scatter dimension of a parameter reduced whole (flat all-reduce)


def path_name(path) -> str:
    """"a/b/c" for a jax key path (the parameter names the layout and the checkpoint use)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@dataclasses.dataclass(frozen=True)
class HierarchicalGradsTransform(GradTransform):
    name: ClassVar[str] = "hierarchical-grads"
    axis: str  # the mesh axis the rows are split over and no parameter is
    node_groups: tuple[tuple[int, ...], ...]  # indices along `axis` that share a node, each group one node
    row_dims: tuple[tuple[str, int], ...]  # each batch array's (and draw's) row dimension
    scatter_dims: tuple[tuple[str, int], ...]  # parameter path -> the dimension scattered inside the node
    in_loop: tuple[str, ...] = ()  # parameter paths of stacked layers, reduced inside the backward loop
    other_row_axes: tuple[str, ...] = ()  # the other mesh axes that split the rows (XLA's)

    def __post_init__(self):
        sizes = {len(g) for g in self.node_groups}
        if len(sizes) != 1:
            raise ValueError(f"node groups {self.node_groups} must all be the same size")

    @property
    def cross_groups(self) -> tuple[tuple[int, ...], ...]:
        """The i-th rank of every node: the groups that all-reduce across the network."""
        return tuple(zip(*self.node_groups))

    def reduce(self, g: jax.Array, dim: int) -> jax.Array:
        """The sum of `g` over `self.axis`, inside the node first."""
        if dim == WHOLE:
            return jax.lax.psum(g, self.axis)
        inner, cross = [list(x) for x in self.node_groups], [list(x) for x in self.cross_groups]
        part = jax.lax.psum_scatter(g, self.axis, scatter_dimension=dim, axis_index_groups=inner, tiled=True)
        part = jax.lax.psum(part, self.axis, axis_index_groups=cross)
        return jax.lax.all_gather(part, self.axis, axis=dim, axis_index_groups=inner, tiled=True)

    def apply(self, grad_fn: Callable) -> Callable:
        dims, in_loop, rows = dict(self.scatter_dims), frozenset(self.in_loop), dict(self.row_dims)

        def local(params, batch, key):
            reduced_in_loop: set[str] = set()

            def hook(params_i, stack_path):
                flat, treedef = jax.tree_util.tree_flatten_with_path(params_i)
                names = ["/".join(stack_path + (path_name(p),)) for p, _ in flat]
                if not any(n in in_loop for n in names):
                    return params_i
                reduced_in_loop.update(names)
                # A stacked parameter's layer slice has lost the leading `layers` dimension.
                layer_dims = tuple(d - 1 if d != WHOLE else WHOLE for d in (dims[n] for n in names))
                return treedef.unflatten(_reduced_in_backward(self, layer_dims)([leaf for _, leaf in flat]))

            with contextlib.ExitStack() as stack:
                stack.enter_context(manual_over((self.axis,)))
                stack.enter_context(rows_split_over(self.other_row_axes))
                if in_loop:
                    stack.enter_context(layer_params_through(hook))
                loss, metrics, grads = grad_fn(params, batch, key)
            if reduced_in_loop != in_loop:  # the model's stacks are not where the pass found them
                raise RuntimeError(f"{self.name}: the layer hook reduced {sorted(reduced_in_loop)[:3]}..., the pass "
                                   f"expected {sorted(in_loop)[:3]}...; re-run the pass on this program")
            loss, metrics = jax.lax.psum((loss, metrics), self.axis)
            flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
            out = []
            for path, g in flat:
                name = path_name(path)
                out.append(g if name in in_loop else self.reduce(g, dims[name]))
            return loss, metrics, treedef.unflatten(out)

        def wrapped(params, batch, key):
            missing = sorted(set(batch) - set(rows))
            if missing:
                raise ValueError(f"{self.name}: no row dimension known for batch arrays {missing}")
            specs = {name: PartitionSpec(*([None] * rows[name]), self.axis) for name in batch}
            return jax.shard_map(local, in_specs=(PartitionSpec(), specs, PartitionSpec()), out_specs=PartitionSpec(),
                                 axis_names={self.axis}, check_vma=False)(params, batch, key)

        return wrapped


def _reduced_in_backward(t: HierarchicalGradsTransform, dims: tuple[int, ...]):
    """The identity on a list of parameters whose backward reduces their gradients."""
    @jax.custom_vjp
    def identity(leaves):
        return leaves

    def fwd(leaves):
        return leaves, None

    def bwd(_, cts):
        return ([t.reduce(c, d) for c, d in zip(cts, dims)],)

    identity.defvjp(fwd, bwd)
    return identity

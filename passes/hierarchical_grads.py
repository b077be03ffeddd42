"""hierarchical-grads: reduce data-parallel gradients inside each node first, so only a node's
share of them crosses the network.

Where the rows are split over the `data` axis, no parameter is split over it, and `data` spans
several nodes with several of its ranks in each, XLA all-reduces every gradient over all data
ranks: each gradient byte crosses the network. This pass installs
`xlaopt.transforms.hierarchical_grads.HierarchicalGradsTransform`: reduce-scatter inside the node,
all-reduce of the shards across nodes, all-gather inside the node, each layer's inside the
backward loop. Where parameters are sharded inside the node (HSDP: fsdp within, data across),
XLA already sends only the shards across (tests/test_grad_sync.py) and the pass does not apply.

The nodes are the topology's (`--topology`); without one, those of a multi-process job (each
process's devices one node).

It pays where the runtime's flat all-reduce is one ring over every rank and the link between
nodes is the slow level: gloo between CPU hosts. Measured in a real 2-process gloo job
(`experiments/grad_sync.py`, BENCHMARKS.md): 1.39x faster over a 0.2 Gbit/s link, slower where the
link is about as fast as the node's own gloo (0.78x at 1 Gbit/s on the 2-core VM). On the GPU
target it is off (`gpu=true` forces it): NCCL already runs a collective across nodes in two levels,
each GPU's rail carrying its share, and the cost model prices it so; written out by hand the three
steps price slower (llama3-8b, 4 layers, data=16 on h100:2x8: gradient synchronisation 68.5 ms ->
87.7 ms a step). jax 0.10.2's cuDNN attention cannot run inside the pass's shard_map at all (its
custom partitioning fails Shardy's verifier there).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import numpy as np

from xlaopt.context import Pass, PassContext, PassResult
from xlaopt.families import family_of
from xlaopt.mesh import DATA as AXIS, MESH_AXES
from xlaopt.program import TrainProgram
from xlaopt.transforms.hierarchical_grads import WHOLE, HierarchicalGradsTransform, path_name


def nodes_of(ctx: PassContext) -> tuple[int, int] | None:
    """(nodes, devices per node) of the cluster the program runs on, when known."""
    if ctx.topology is not None:
        return ctx.topology.nodes, ctx.topology.devices_per_node
    if jax.process_count() > 1:
        return jax.process_count(), jax.local_device_count()
    return None


def node_groups(program: TrainProgram, devices_per_node: int) -> tuple[tuple[int, ...], ...] | str:
    """The indices along `data` that share a node, the same for every position on the other
    axes; or why there are none."""
    mesh = program.mesh
    nodes_LA = (np.array(mesh.placement()) // devices_per_node).reshape([mesh.size(a) for a in MESH_AXES])
    by_position = np.moveaxis(nodes_LA, MESH_AXES.index(AXIS), -1).reshape(-1, mesh.size(AXIS))
    groupings = set()
    for nodes in by_position:
        groups = {}
        for index, node in enumerate(nodes):
            groups.setdefault(int(node), []).append(index)
        groupings.add(tuple(sorted(tuple(g) for g in groups.values())))
    if len(groupings) != 1:
        return "the data ranks that share a node differ between positions on the other mesh axes"
    (groups,) = groupings
    if len(groups) == 1:
        return "data parallelism stays inside one node: no gradient crosses the network"
    if len({len(g) for g in groups}) != 1 or len(groups[0]) == 1:
        return (f"each node holds {'one data rank' if len(groups[0]) == 1 else 'unequal numbers of data ranks'}: "
                f"nothing to reduce inside a node first")
    return groups


@dataclasses.dataclass(frozen=True)
class HierarchicalGrads(Pass):
    name: ClassVar[str] = "hierarchical-grads"
    summary: ClassVar[str] = ("reduce data-parallel gradients in two levels: reduce-scatter in the node, all-reduce "
                              "the shards across nodes, all-gather in the node; each layer's inside the backward loop")
    gpu: bool = False  # apply on the GPU target too (NCCL does this itself; priced slower, see above)

    def why_not(self, program: TrainProgram, ctx: PassContext) -> str | None:
        reason = self._plan(program, ctx)
        return reason if isinstance(reason, str) else None

    def _plan(self, program: TrainProgram, ctx: PassContext):
        from xlaopt.step import why_rows_not_manual_over_data

        if program.shardings is None:
            return "needs a layout (run mesh-layout first)"
        if ctx.target == "gpu" and not self.gpu:
            return ("on the GPU target NCCL already reduces across nodes in two levels (each GPU's rail carrying its "
                    "share) and the cost model prices it so; force with --pass-option hierarchical-grads.gpu=true")
        if program.execution.attention == "cudnn":
            return (f"attention=cudnn cannot run inside the pass's shard_map on jax {jax.__version__} (its custom "
                    f"partitioning fails Shardy's verifier there); use attention=segment")
        if program.execution.layer_stack == "pipeline":
            return ("layer_stack=pipeline: the pass reduces each layer's gradient inside the backward loop, which "
                    "under a pipeline runs once per tick (micro-batches + stages - 1 times a step), not once")
        reason = why_rows_not_manual_over_data(program)
        if reason:
            return reason
        cluster = nodes_of(ctx)
        if cluster is None:
            return "no topology and one process: the nodes are unknown (give --topology, e.g. h100:2x4)"
        groups = node_groups(program, cluster[1])
        return groups

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        from xlaopt.sharding import batch_axes, entry_axes
        from xlaopt.step import batch_spec

        groups = self._plan(program, ctx)
        per_node = len(groups[0])
        params, logical = ctx.cache.params_with_axes(program)
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        specs = treedef.flatten_up_to(program.shardings.state.params)
        axes = treedef.flatten_up_to(logical)
        scatter, in_loop = [], []
        total = crossing = 0
        for (path, leaf), spec, names in zip(flat, specs, axes):
            name = path_name(path)
            stacked = len(names) > 0 and names[0] == "layers"
            split = [i < len(spec) and spec[i] is not None for i in range(leaf.ndim)]
            fits = [d for d in range(int(stacked), leaf.ndim) if not split[d] and leaf.shape[d] % per_node == 0]
            dim = max(fits, key=lambda d: leaf.shape[d]) if fits else WHOLE
            scatter.append((name, dim))
            if stacked:
                in_loop.append(name)
            nbytes = 4 * math.prod(leaf.shape)  # fp32 gradients
            ways = math.prod(program.mesh.size(a) for entry in spec for a in entry_axes(entry))
            total += nbytes // ways
            crossing += nbytes // ways // (per_node if dim != WHOLE else 1)
        family = family_of(program.model)
        rows = {n: list(a).index("batch") for n, (_, _, a) in batch_spec(program).items()}
        rows.update({n: list(a).index("batch") for n, a in family.draw_axes})
        transform = HierarchicalGradsTransform(AXIS, groups, tuple(sorted(rows.items())), tuple(scatter), tuple(in_loop),
                                           tuple(a for a in batch_axes(program) if a != AXIS))
        new = program.with_grad_transform(transform)
        return PassResult(new, new != program, {
            "nodes": len(groups), "data_ranks_per_node": per_node,
            "gradient_bytes_per_device": total, "network_bytes_flat": total, "network_bytes": crossing,
            "reduced_whole": [n for n, d in scatter if d == WHOLE],
            "in_backward_loop": len(in_loop)})

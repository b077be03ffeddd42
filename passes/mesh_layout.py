"""mesh-layout: apply the logical-axis rule table to the mesh.

Resolves every parameter, optimizer-state and batch array's logical axes into mesh
PartitionSpecs (first matching rule wins, size-1 mesh axes dropped), checks that each
sharded dimension divides, and turns on activation constraints from the same table.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from xlaopt.context import Pass, PassContext, PassResult
from xlaopt.program import ProgramShardings, TrainProgram, TrainState
from xlaopt.sharding import RuleUse, logical_to_spec, over_data
from xlaopt.step import batch_spec, make_optimizer, trained_part
from xlaopt.transforms.hierarchical_grads import path_name


@dataclasses.dataclass(frozen=True)
class MeshLayout(Pass):
    name: ClassVar[str] = "mesh-layout"
    summary: ClassVar[str] = ("apply the logical-axis rule table to the mesh: shard params, optimizer state, batch, "
                              "activations")
    # Constrain activations by the same table while the model is traced (else XLA propagates).
    constrain_activations: bool = True

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        use = RuleUse()
        params, logical = ctx.cache.params_with_axes(program)
        flat_params, treedef = jax.tree_util.tree_flatten_with_path(params)
        flat_logical = treedef.flatten_up_to(logical)
        param_specs = treedef.unflatten([
            logical_to_spec(tuple(axes), leaf.shape, program.rules, program.mesh, f"param {path_name(path)}", use)
            for (path, leaf), axes in zip(flat_params, flat_logical)])

        state = ctx.cache.abstract_state(program)
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        # ZeRO-1: the moments split over data too (AdamW's count, a scalar, stays whole).
        zero1 = program.execution.sharded_optimizer
        opt_spec = (lambda leaf, spec: over_data(spec, leaf.shape, program.mesh)) if zero1 else (  # noqa: E731
            lambda _, spec: spec)
        opt_specs = optax.tree_map_params(make_optimizer(program.settings), opt_spec, state.opt_state,
                                          trained_part(program, param_specs, is_leaf=is_spec),
                                          transform_non_params=lambda _: PartitionSpec(), is_leaf=is_spec)
        batch_specs = {name: logical_to_spec(axes, shape, program.rules, program.mesh, f"batch array {name}", use)
                       for name, (shape, _, axes) in batch_spec(program).items()}
        # Checked as compiling constrains them: inside a rewrite's shard_map (hierarchical-grads' over
        # data) an activation is one device's part along the manual axes.
        for shape, axes, manual in ctx.cache.activation_axes(program):
            logical_to_spec(axes, shape, program.rules, program.mesh.inside_manual(manual), f"activation {axes}", use)
        scale_specs = jax.tree.map(lambda _: PartitionSpec(), state.loss_scale)  # scalars, replicated
        model_state_specs = jax.tree.map(lambda _: PartitionSpec(), state.model_state)  # per-channel vectors
        shardings = ProgramShardings.of(TrainState(PartitionSpec(), param_specs, opt_specs, scale_specs,
                                                   model_state_specs), batch_specs,
                                        self.constrain_activations)
        new = program.replace(shardings=shardings)
        return PassResult(new, new != program, self._report(program, params, param_specs, use))

    @staticmethod
    def _report(program, params, param_specs, use: RuleUse) -> dict:
        leaves = jax.tree.leaves(params)
        specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        total = per_device = 0
        sharded = 0
        for leaf, spec in zip(leaves, specs):
            nbytes = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
            ways = int(np.prod([program.mesh.size(a) for s in spec if s
                                for a in (s if isinstance(s, tuple) else (s,))]))
            total += nbytes
            per_device += nbytes // ways
            sharded += ways > 1
        return {"mesh": program.mesh.as_dict(), "params": len(leaves), "params_sharded": sharded,
                "param_bytes": total, "param_bytes_per_device": per_device,
                "unused_rules": use.unused(program.rules)}

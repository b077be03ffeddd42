"""Where inference arrays live on a device mesh: `Placement`, for KV-cached decoding
(`inference.decode`) and cached Cosmos 3 sampling (`inference.sample_cosmos`).

Inference lays out what training lays out, by the same rule table (`xlaopt.sharding`):
  - parameters take exactly the specs the `mesh-layout` pass gives a TrainProgram of the same
    model, mesh and rules (so a checkpoint saved by training on this mesh places as saved);
    inference holds no optimizer state or gradients;
  - the request's rows, its activations and its KV caches resolve their logical axes through
    the same table: rows over the batch axes (data, fsdp), kv heads over tensor;
  - the model is traced under the mesh with the training program's activation constraints
    (`compile._tracing_context`), so tensor-parallel attention and MLPs shard as in training.
One difference: a training batch is chosen to divide the batch axes, a request has however
many rows it has, so an array whose rows do not divide them is replicated over them instead
(the table without its `batch` rule) rather than refused. The `context` axis splits a row's
positions, which only Cosmos 3 sampling asks for (`positions=True`: its attention runs through
Ulysses, `sample_cosmos.ulysses`); decoding a token at a time refuses it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xlaopt.mesh import MeshError, MeshSpec, make_mesh
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.sharding import DEFAULT_RULES, Rule, logical_to_spec, mesh_axes_of, with_sequence_parallel

ROWS = "batch"  # the logical axis of a request's rows


@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh and the training layout of one model on it (`program`: a TrainProgram with the
    `mesh-layout` pass applied), read for inference."""
    program: TrainProgram
    mesh: jax.sharding.Mesh

    @classmethod
    def on(cls, config, spec: MeshSpec, execution, rules: Sequence[Rule] = DEFAULT_RULES,
           mesh: jax.sharding.Mesh | None = None, positions: bool = False) -> "Placement":
        """The placement of `config`'s model (built with `execution`) on `spec`'s mesh (`mesh`:
        its devices, e.g. a deviceless GPU compile's; default the simulated CPU devices); a
        one-line MeshError when the mesh lacks devices or an axis does not divide a parameter.
        `positions`: the caller splits a row's positions over `context` (Cosmos 3 sampling, by
        Ulysses); decoding does not."""
        from xlaopt.context import PassContext
        from xlaopt.families import family_of
        from xlaopt.passes.mesh_layout import MeshLayout

        if spec.size("context") > 1 and not positions:
            raise MeshError(f"mesh {spec}: context={spec.size('context')} would split positions, which decoding "
                            f"does not (it splits rows over data/fsdp and heads over tensor); drop context")
        mesh = make_mesh(spec) if mesh is None else mesh
        target = "gpu" if mesh.devices.flat[0].platform in ("gpu", "cuda") else "cpu"
        # mesh-layout also resolves a training batch and a traced step's activations; one row per
        # device divides however the rules split rows (only the parameters' specs are read here).
        batch = dataclasses.replace(family_of(config).default_batch(config), batch_size=spec.num_devices)
        # Sequence parallelism is a training choice: a decode step's one token does not split,
        # and the parameters it would leave whole are laid out the same either way.
        rules = with_sequence_parallel(rules, on=False)
        program = TrainProgram(config, spec, rules=rules, settings=TrainSettings(batch=batch),
                               execution=execution, target=target)
        laid_out = MeshLayout().run(program, PassContext.for_program(program)).program
        return cls(laid_out, mesh)

    @property
    def spec(self) -> MeshSpec:
        return self.program.mesh

    @property
    def param_specs(self):
        """The parameters' PartitionSpecs, as training lays them out."""
        return self.program.shardings.state.params

    @property
    def param_shardings(self):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def rules_for(self, rows: int) -> tuple[Rule, ...]:
        """The rule table for arrays of `rows` rows: the program's, less its batch rule when the
        rows do not divide the batch axes (such arrays are replicated over them)."""
        try:
            mesh_axes_of(ROWS, rows, self.program.rules, self.spec, f"{rows} rows")
            return self.program.rules
        except MeshError:
            return tuple(rule for rule in self.program.rules if rule[0] != ROWS)

    def row_axes(self, rows: int) -> tuple[str, ...]:
        """The mesh axes `rows` rows are split over (none when they do not divide)."""
        return mesh_axes_of(ROWS, rows, self.rules_for(rows), self.spec, f"{rows} rows")

    def spec_of(self, logical_axes: Sequence[str | None], shape: Sequence[int], what: str) -> PartitionSpec:
        axes = tuple(logical_axes)
        rows = shape[axes.index(ROWS)] if ROWS in axes else 1
        return logical_to_spec(axes, tuple(shape), self.rules_for(rows), self.spec, what)

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int], what: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec_of(logical_axes, shape, what))

    def put(self, x, logical_axes: Sequence[str | None], what: str = "an input") -> jax.Array:
        """A host or device array onto the mesh by its logical axes (a no-op where it is already there)."""
        return jax.device_put(x, self.sharding(logical_axes, np.shape(x), what))

    def put_tree(self, tree: dict, axes: dict, what: str = "input") -> dict:
        """`put` of each entry of a dict of arrays, by `axes[name]`."""
        return {k: self.put(v, axes[k], f"{what} {k}") for k, v in tree.items()}

    def replicate(self, x) -> Any:
        """Scalars and keys: whole on every device."""
        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec()))

    def put_params(self, params):
        """The parameters onto the mesh in their training layout."""
        return jax.device_put(params, self.param_shardings)

    @contextlib.contextmanager
    def tracing(self, rows: int):
        """Trace (and compile) a model function of `rows` rows under the mesh, with the training
        layout's activation constraints (`compile._tracing_context`) resolved for those rows."""
        from xlaopt.compile import _tracing_context

        program = self.program
        batch = dataclasses.replace(program.settings.batch, batch_size=rows)
        for_rows = program.replace(rules=self.rules_for(rows),
                                   settings=dataclasses.replace(program.settings, batch=batch))
        with _tracing_context(for_rows, self.mesh):
            yield


def placement_or_none(config, spec: MeshSpec, execution, rules: Sequence[Rule] = DEFAULT_RULES,
                      positions: bool = False) -> Placement | None:
    """`Placement.on` for a mesh of more than one device; None for one device (nothing to place)."""
    return None if spec.num_devices == 1 else Placement.on(config, spec, execution, rules, positions=positions)


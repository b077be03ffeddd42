"""The training program every pass reads and rewrites.

A `TrainProgram` is a frozen, comparable description, not compiled code: passes return
a new one (so `changed` is simply `new != old`), and `xlaopt.compile` turns it into
jitted functions. It has room for the three levels passes work at:
  - program spec: model config, mesh, rule table, shardings, settings;
  - traced function: `grad_transforms`, applied in order to the gradient function
    (shard_map rewrites, collective reordering);
  - compiled HLO: `compiler_options` and `hlo_transforms` (callbacks registered with
    `jax.extend.xla.register_hlo_module_transformation` for the program's compilation).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec
from xlaopt.sharding import DEFAULT_RULES, Rule, validate_rules

DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    batch: BatchShape = BatchShape()
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        if self.compute_dtype not in DTYPES:
            raise UserError(f"compute dtype {self.compute_dtype!r}; use one of {', '.join(DTYPES)}")


class TrainState(NamedTuple):
    step: Any
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class ProgramShardings:
    """Mesh PartitionSpecs for the train state and batch, and whether activations are
    constrained by the rule table while the model is traced."""
    state: TrainState
    batch: dict
    constrain_activations: bool = True


@dataclasses.dataclass(frozen=True)
class NamedTransform:
    """A traced-function rewrite: `fn(grad_fn) -> grad_fn`, named for reports and dumps."""
    name: str
    fn: Callable


@dataclasses.dataclass(frozen=True)
class HloTransform:
    """A compiled-HLO rewrite: `callback(serialized HloModuleProto) -> bytes | None`."""
    name: str
    callback: Callable[[bytes], bytes | None]
    post_scheduler: bool = False


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    model: Any  # a registered model config (see xlaopt.models.registry)
    mesh: MeshSpec = MeshSpec()
    rules: tuple[Rule, ...] = DEFAULT_RULES
    settings: TrainSettings = TrainSettings()
    shardings: ProgramShardings | None = None  # None: replicated everywhere (no layout applied)
    grad_transforms: tuple[NamedTransform, ...] = ()
    compiler_options: tuple[tuple[str, str], ...] = ()
    hlo_transforms: tuple[HloTransform, ...] = ()

    def __post_init__(self):
        validate_rules(self.rules)

    def replace(self, **changes) -> "TrainProgram":
        return dataclasses.replace(self, **changes)

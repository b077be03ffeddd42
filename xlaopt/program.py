"""The training program every pass reads and rewrites.

A `TrainProgram` is a frozen, hashable description, not compiled code: passes return a new
one (so `changed` is simply `new != old`, and a planner can cache prices by program), and
`xlaopt.compile` turns it into jitted functions. It has room for the levels passes work at:
  - what is trained: model config, optimizer and batch settings (a resume must match these);
  - how it executes: the execution config (precision, remat, attention, layer stack,
    micro-batches) and the target compiler (cpu or gpu); a resume accepts any of these;
  - the layout: mesh, rule table, shardings;
  - traced function: `grad_transforms`, applied in order to the gradient function;
  - compiled HLO: `compiler_options` and `hlo_transforms` (see `xlaopt.transforms`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import TARGETS, ExecutionConfig
from xlaopt.families import FAMILIES, family_of
from xlaopt.mesh import STAGE, MeshSpec
from xlaopt.models.pipeline import PipelineSchedule
from xlaopt.sharding import DEFAULT_RULES, Rule, sequence_axes, validate_rules

NONFINITE = ("none", "stop", "skip")
from xlaopt.transforms import GradTransform, HloTransform
from xlaopt.transforms.compiler_options import CompilerOptions
from xlaopt.transforms.ulysses_attention import ulysses_split


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    batch: BatchShape = BatchShape()
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # What a step checks of its loss, gradients and updated state being finite: "none"; "stop":
    # it reports `nonfinite` (the training loop stops before saving such a state); "skip": such
    # a step leaves the state as it was (`skipped`), as float16's loss scaling does on overflow.
    nonfinite: str = "none"
    # Which parameters the step trains, by the family's set name (`Family.trainable_sets`); the
    # rest are frozen: no gradient is computed for them, they have no optimizer state, and the
    # step leaves them as they are. "all" trains everything.
    trainable: str = "all"

    def __post_init__(self):
        if self.nonfinite not in NONFINITE:
            raise UserError(f"nonfinite={self.nonfinite!r}: choose one of {', '.join(NONFINITE)}")


class TrainState(NamedTuple):
    step: Any
    params: Any
    opt_state: Any
    # `xlaopt.loss_scale.LossScale` under float16; None (no leaves, so checkpoints of other
    # dtypes are unchanged) otherwise.
    loss_scale: Any = None
    # The model's non-parameter state (`Family.init_state`: a ResNet's running batch-norm
    # averages); None, no leaves, for the other families.
    model_state: Any = None


@dataclasses.dataclass(frozen=True)
class ProgramShardings:
    """Mesh PartitionSpecs for the train state and batch, and whether activations are
    constrained by the rule table while the model is traced. Held flat (a tree structure and
    its leaves, batch specs as sorted pairs) so that a program hashes and compares by value."""
    state_treedef: Any  # jax PyTreeDef of the TrainState of specs
    state_leaves: tuple[PartitionSpec, ...]
    batch_items: tuple[tuple[str, PartitionSpec], ...]
    constrain_activations: bool = True

    @classmethod
    def of(cls, state: TrainState, batch: dict[str, PartitionSpec], constrain_activations: bool = True):
        leaves, treedef = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return cls(treedef, tuple(leaves), tuple(sorted(batch.items())), constrain_activations)

    @property
    def state(self) -> TrainState:
        return jax.tree.unflatten(self.state_treedef, self.state_leaves)

    @property
    def batch(self) -> dict[str, PartitionSpec]:
        return dict(self.batch_items)


def cudnn_takes_sequence(model, mesh: MeshSpec, seq_axes: tuple[str, ...]) -> bool:
    """Whether cuDNN's attention can run on rows whose sequence `mesh` splits over `seq_axes`:
    unsplit, or split over context alone where Ulysses can hand each rank whole rows with a
    share of the heads (`ulysses_split`)."""
    if not seq_axes:
        return True
    heads, kv_heads = getattr(model, "num_heads", 0), getattr(model, "num_kv_heads", 0)
    return seq_axes == ("context",) and ulysses_split(heads, kv_heads, mesh.size("tensor"),
                                                      mesh.size("context")) is not None


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    model: Any  # a registered model config (see xlaopt.models.registry)
    mesh: MeshSpec = MeshSpec()
    rules: tuple[Rule, ...] = DEFAULT_RULES
    settings: TrainSettings = TrainSettings()
    execution: ExecutionConfig = ExecutionConfig()
    target: str = "cpu"  # the compiler the program is built for: XLA's CPU or (deviceless) GPU pipeline
    shardings: ProgramShardings | None = None  # None: replicated everywhere (no layout applied)
    grad_transforms: tuple[GradTransform, ...] = ()
    compiler_options: CompilerOptions = CompilerOptions()
    hlo_transforms: tuple[HloTransform, ...] = ()

    def __post_init__(self):
        validate_rules(self.rules)
        if self.target not in TARGETS:
            raise UserError(f"target {self.target!r}; use one of {', '.join(TARGETS)}")
        if not isinstance(self.compiler_options, CompilerOptions):
            object.__setattr__(self, "compiler_options", CompilerOptions(self.compiler_options))
        self.compiler_options.check_target(self.target)
        if self.execution.attention == "cudnn" and self.target != "gpu":
            raise UserError(f"execution setting attention=cudnn is JAX's cuDNN fused attention, which runs on NVIDIA "
                            f"GPUs only; the {self.target} target needs attention=segment (the same pairs skipped) "
                            f"or dense, or compile for --target gpu")
        if self.execution.attention == "cudnn":
            self._check_cudnn_sequence()
        self.execution.check_batch(self.settings.batch.batch_size)
        self._check_pipeline()
        family = family_of(self.model)
        if self.settings.trainable not in family.trainable_names:
            raise UserError(f"trainable={self.settings.trainable!r}: the {family.name} family's parameter sets are "
                            f"{', '.join(family.trainable_names)}")
        for kind, transforms, base in (("grad", self.grad_transforms, GradTransform),
                                       ("HLO", self.hlo_transforms, HloTransform)):
            for t in transforms:
                if not isinstance(t, base):
                    raise TypeError(f"{kind} transform {t!r} is not a {base.__name__} (a frozen dataclass "
                                    f"compared by value)")

    def _check_cudnn_sequence(self) -> None:
        """jax 0.10.2's cuDNN attention partitioner refuses a split sequence ("Sharding on sequence
        dim is not allowed"): a context-split row reaches it only through Ulysses (whole rows, a
        share of the heads; the ulysses-attention pass), which needs whole kv heads on each
        context rank. That the transform is there is checked when the program compiles."""
        seq_axes = self.sequence_axes
        if cudnn_takes_sequence(self.model, self.mesh, seq_axes):
            return
        context, tensor = self.mesh.size("context"), self.mesh.size("tensor")
        heads, kv_heads = getattr(self.model, "num_heads", 0), getattr(self.model, "num_kv_heads", 0)
        works = [c for c in range(1, heads // tensor + 1) if ulysses_split(heads, kv_heads, tensor, c)]
        raise UserError(f"execution setting attention=cudnn cannot split a row's sequence (mesh {self.mesh} "
                        f"splits it over {','.join(seq_axes)}): jax {jax.__version__}'s cuDNN attention refuses "
                        f"a sharded sequence, and Ulysses (whole rows, heads split over context) needs the "
                        f"{heads // tensor} query heads of each tensor rank to split over context={context}; "
                        f"use a context size of {', '.join(map(str, works)) or 'none'}, or attention=segment")

    def _check_pipeline(self) -> None:
        stages, execution = self.mesh.size(STAGE), self.execution
        if execution.layer_stack != "pipeline":
            if stages > 1:
                raise UserError(f"mesh {self.mesh} cuts the layers into {stages} pipeline stages, which only a "
                                f"pipeline runs; add --exec layer_stack=pipeline, or drop {STAGE} from the mesh")
            return
        if not family_of(self.model).has_layer_stack:
            raise UserError(f"execution setting layer_stack=pipeline: {type(self.model).__name__} has no stack of "
                            f"layers to cut into stages; use layer_stack=scan")
        if execution.compute_dtype == "bfloat16" and self.target == "cpu" and stages > 1:
            # Checked in tests/test_pipeline_parallel.py: the process aborts inside XLA:CPU's compile.
            raise UserError(f"layer_stack=pipeline in bfloat16 aborts XLA:CPU's compile on jax {jax.__version__} "
                            f"(the GPU target compiles it); on the cpu target use --dtype float32 or float16")
        layers = self.model.num_layers
        if layers % stages:
            raise UserError(f"mesh {self.mesh}: {stages} pipeline stages do not divide the model's {layers} layers; "
                            f"pick a {STAGE} size that divides {layers} "
                            f"({', '.join(str(d) for d in range(1, layers + 1) if layers % d == 0)})")
        microbatches = execution.pipeline_microbatches or stages
        if microbatches % stages:
            raise UserError(f"execution setting pipeline_microbatches={microbatches} is not a multiple of the "
                            f"{stages} pipeline stages; use {stages}, {2 * stages}, ... (or 0: one per stage)")
        try:
            PipelineSchedule(stages, microbatches, execution.pipeline_schedule,
                             execution.pipeline_virtual_stages).check_layers(layers)
        except ValueError as e:
            raise UserError(f"execution setting pipeline_virtual_stages={execution.pipeline_virtual_stages}: {e}") \
                from None
        family = family_of(self.model)
        if execution.pipeline_schedule == "1f1b" and not family.loss_in_stack:
            raise UserError(f"pipeline_schedule=1f1b runs the loss inside the layer stack, which the {family.name} "
                            f"family does not do yet (the "
                            f"{' and '.join(n for n, f in FAMILIES.items() if f.loss_in_stack)} families do); use "
                            f"pipeline_schedule=gpipe")
        row_axes = next((axes for logical, axes in self.rules if logical == "batch"), ())
        shards = math.prod(self.mesh.size(a) for a in row_axes if a != STAGE)
        rows = self.settings.batch.batch_size // execution.micro_batches
        if rows % (microbatches * shards):
            need = microbatches * shards * execution.micro_batches
            raise UserError(f"layer_stack=pipeline: the step's {rows} rows (each accumulation micro-batch's) do not "
                            f"split into {microbatches} pipeline micro-batches over {shards} row shards; use a "
                            f"global batch that is a multiple of {need}, or fewer pipeline_microbatches")

    @property
    def pipeline_schedule(self) -> PipelineSchedule | None:
        """The pipeline's schedule on this mesh; None where the layers are not pipelined over stages."""
        stages = self.mesh.size(STAGE)
        if self.execution.layer_stack != "pipeline" or stages == 1:
            return None
        execution = self.execution
        return PipelineSchedule(stages, execution.pipeline_microbatches or stages, execution.pipeline_schedule,
                                execution.pipeline_virtual_stages)

    def replace(self, **changes) -> "TrainProgram":
        return dataclasses.replace(self, **changes)

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        return sequence_axes(self.rules, self.mesh)

    def with_grad_transform(self, transform: GradTransform) -> "TrainProgram":
        """The program with `transform` in place of its transform of the same kind, where it has
        one (so a pass run again keeps the order the first run gave), else applied last."""
        kinds = [type(t) for t in self.grad_transforms]
        if type(transform) not in kinds:
            return self.replace(grad_transforms=self.grad_transforms + (transform,))
        at = kinds.index(type(transform))
        return self.replace(grad_transforms=self.grad_transforms[:at] + (transform,) + self.grad_transforms[at + 1:])

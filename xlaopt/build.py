"""One way from what a user asks for to a `TrainProgram`: the command line, the Python API
(`xlaopt.build_program`) and the planner build theirs here, so a setting means the same wherever
it is given. Field by field, what is given wins, then a layout file's, then the defaults (the
family's batch, `ExecutionConfig()`, one device)."""
from __future__ import annotations

import dataclasses
import os

from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig, target_attention
from xlaopt.families import family_of
from xlaopt.layout import Layout, load_layout
from xlaopt.mesh import MeshSpec
from xlaopt.program import TrainProgram, TrainSettings, cudnn_takes_sequence
from xlaopt.sharding import sequence_axes, with_sequence_parallel
from xlaopt.transforms.compiler_options import CompilerOptions

_BATCH_FIELDS = ("batch_size", "text_len", "gen_len")


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """The batch fields a user gave; None is "not given", left to a layout file or a default."""
    batch_size: int | None = None
    text_len: int | None = None
    gen_len: int | None = None

    def over(self, fallback: BatchShape | BatchRequest | None) -> BatchRequest:
        """These fields, each one not given taken from `fallback`."""
        if fallback is None:
            return self
        return BatchRequest(*(getattr(fallback, f) if getattr(self, f) is None else getattr(self, f)
                              for f in _BATCH_FIELDS))

    def shape(self, default: BatchShape) -> BatchShape:
        return BatchShape(*dataclasses.astuple(self.over(default)))


def choose_layout(mesh: str | MeshSpec, layout_file: str | os.PathLike | None, model: str,
                  sequence_parallel: bool = False) -> Layout:
    """The layout of a mesh (default rules and device order) or of a layout file, whose model
    must be `model`; not both, since a layout file holds its mesh. `sequence_parallel` turns it on
    in either's rules (`xlaopt.sharding.with_sequence_parallel`)."""
    if layout_file is None:
        layout = Layout(mesh if isinstance(mesh, MeshSpec) else MeshSpec.parse(mesh))
    elif mesh:
        raise UserError("--mesh and --layout both given; a layout file holds its mesh, pass one or the other")
    else:
        layout = load_layout(layout_file)
        layout.check_model(model, str(layout_file))
    if not sequence_parallel:
        return layout
    if layout.mesh.size("tensor") == 1:
        raise UserError(f"--sequence-parallel splits the residual stream over the tensor ranks, and mesh {layout.mesh} "
                        f"has none; add tensor=N (N > 1) or drop --sequence-parallel")
    return dataclasses.replace(layout, rules=with_sequence_parallel(layout.rules))


def default_execution(layout: Layout, target: str, config) -> ExecutionConfig:
    """The execution a program of `config` on `layout` for `target` runs where nothing says
    otherwise: the layout file's, else `ExecutionConfig()` with the target's attention (the
    planner's choice there: cuDNN on a GPU, through Ulysses on a context split where it can
    take it), so a compile for the GPU prices what the job would run."""
    if layout.execution is not None:
        return layout.execution
    seq_axes = sequence_axes(layout.rules, layout.mesh)
    return ExecutionConfig(attention=target_attention(target, not cudnn_takes_sequence(config, layout.mesh, seq_axes)))


def build_program(config, layout: Layout | None = None, batch: BatchShape | None = None,
                  execution: ExecutionConfig | None = None, *, seed: int = 0, learning_rate: float | None = None,
                  nonfinite: str | None = None, target: str = "cpu",
                  compiler_options: CompilerOptions | dict | None = None, trainable: str = "all") -> TrainProgram:
    """The program of a model config on a layout (default: one device), with the batch (default:
    the family's) and the execution (default: `default_execution`); `learning_rate` and
    `nonfinite` replace `TrainSettings`' own where given; `trainable` as `TrainSettings.trainable`."""
    layout = layout or Layout(MeshSpec())
    settings = TrainSettings(batch=batch or family_of(config).default_batch(config), seed=seed, trainable=trainable)
    if learning_rate is not None:
        settings = dataclasses.replace(settings, learning_rate=learning_rate)
    if nonfinite is not None:
        settings = dataclasses.replace(settings, nonfinite=nonfinite)
    return TrainProgram(config, layout.mesh, rules=layout.rules, settings=settings,
                        execution=execution or default_execution(layout, target, config), target=target,
                        compiler_options=compiler_options or CompilerOptions())

"""Passes and the one ordered pipeline.

A pass has a stable kebab-case `name`, a one-line `summary`, and
`run(program) -> PassResult(program, changed, report)`; it never mutates its input.
The pipeline checks between passes that `changed` is honest (equal to `new != old`),
can dump the lowered and compiled HLO after each pass, and names the failing pass and
the ones that ran before it when something goes wrong.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Protocol, Sequence

from xlaopt.errors import UserError
from xlaopt.program import TrainProgram

_KEBAB = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclasses.dataclass(frozen=True)
class PassResult:
    program: TrainProgram
    changed: bool
    report: dict[str, Any]


class Pass(Protocol):
    name: str
    summary: str

    def run(self, program: TrainProgram) -> PassResult: ...


class PipelineError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class PassRecord:
    name: str
    changed: bool
    report: dict[str, Any]
    dumped: tuple[str, ...] = ()


def pipeline() -> tuple[Pass, ...]:
    """The one ordered pipeline. Later passes (layout planning, overlap, precision) go here."""
    from xlaopt.passes.mesh_layout import MeshLayout

    return (MeshLayout(),)


def select_passes(passes: Sequence[Pass], only: Sequence[str] | None = None,
                  disable: Sequence[str] = ()) -> tuple[Pass, ...]:
    """The pipeline's passes restricted to `only` (in pipeline order) minus `disable`."""
    names = [p.name for p in passes]
    for name in list(only or ()) + list(disable):
        if name not in names:
            raise UserError(f"unknown pass {name!r}; passes are: {', '.join(names) or '(none)'} "
                            f"(see `xlaopt passes`)")
    chosen = [p for p in passes if (only is None or p.name in only) and p.name not in disable]
    return tuple(chosen)


def run_pipeline(program: TrainProgram, passes: Sequence[Pass], dump_dir: str | pathlib.Path | None = None
                 ) -> tuple[TrainProgram, list[PassRecord]]:
    records: list[PassRecord] = []
    if dump_dir is not None:
        _dump(program, pathlib.Path(dump_dir), 0, "input")
    for index, p in enumerate(passes, start=1):
        if not _KEBAB.match(p.name):
            raise PipelineError(f"pass name {p.name!r} is not kebab-case")
        ran = ", ".join(r.name for r in records) or "none"
        try:
            result = p.run(program)
        except UserError as e:
            raise type(e)(f"{p.name}: {e}") from e
        except Exception as e:
            raise PipelineError(f"pass {p.name!r} failed (passes run before it: {ran}): {e}") from e
        actually_changed = result.program != program
        if result.changed != actually_changed:
            raise PipelineError(f"pass {p.name!r} reported changed={result.changed} but the program "
                                f"{'did' if actually_changed else 'did not'} change (passes run before it: {ran})")
        dumped = ()
        if dump_dir is not None:
            dumped = _dump(result.program, pathlib.Path(dump_dir), index, p.name)
        records.append(PassRecord(p.name, result.changed, result.report, dumped))
        program = result.program
    return program, records


def _dump(program: TrainProgram, dump_dir: pathlib.Path, index: int, name: str) -> tuple[str, ...]:
    from xlaopt.compile import compile_program

    dump_dir.mkdir(parents=True, exist_ok=True)
    compiled = compile_program(program)
    stem = dump_dir / f"{index:02d}-{name}"
    lowered_path, compiled_path = stem.with_suffix(".lowered.mlir"), stem.with_suffix(".compiled.hlo")
    lowered_path.write_text(compiled.lowered.as_text())
    compiled_path.write_text(compiled.train_step.as_text())
    return str(lowered_path), str(compiled_path)

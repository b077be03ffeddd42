"""Passes and the one ordered pipeline.

A pass derives `xlaopt.context.Pass`: a frozen dataclass with a stable kebab-case `name` and a
one-line `summary` (class variables), its options as fields, `why_not(program, ctx)` and
`run(program, ctx) -> PassResult(program, changed, report)`; it never mutates its input. `ctx`
(`xlaopt.context.PassContext`) carries the target, the topology and a cache. Between passes the
pipeline checks that `changed` is honest (equal to `new != old`), the pass's own `ensures` and the
invariants every program keeps (`INVARIANTS`); it can dump, after each pass that changed
the program, what changed beside the lowered and compiled HLO, and names the failing pass and the
ones that ran before it when something goes wrong.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Mapping, Sequence, get_type_hints

from xlaopt.context import OffUnlessEnabled, Pass, PassContext
from xlaopt.errors import UserError
from xlaopt.program import TrainProgram

_KEBAB = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


class PipelineError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class PassRecord:
    name: str
    changed: bool
    report: dict[str, Any]
    dumped: tuple[str, ...] = ()


def pass_classes() -> tuple[type, ...]:
    """The one ordered pipeline: the layout is chosen, then applied, then its communication
    restructured and overlapped."""
    from xlaopt.passes.collective_matmul import CollectiveMatmul
    from xlaopt.passes.hierarchical_grads import HierarchicalGrads
    from xlaopt.passes.layout_plan import LayoutPlan
    from xlaopt.passes.mesh_layout import MeshLayout
    from xlaopt.passes.overlap_flags import OverlapFlags
    from xlaopt.passes.ulysses_attention import UlyssesAttention

    return (LayoutPlan, MeshLayout, HierarchicalGrads, CollectiveMatmul, UlyssesAttention, OverlapFlags)


def pipeline(options: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[Pass, ...]:
    """The pipeline's passes, each built with its options (`{pass name: {field: value}}`)."""
    options = dict(options or {})
    classes = {cls.name: cls for cls in pass_classes()}
    for name in options:
        if name not in classes:
            raise UserError(f"options for unknown pass {name!r}; passes are: {', '.join(classes)}")
    return tuple(cls(**options.get(name, {})) for name, cls in classes.items())


def after_planning(program: TrainProgram, topology) -> TrainProgram:
    """`program` through the passes that follow layout-plan, with their defaults: what the
    planner compiles a candidate after (`planning.planner.plan`'s `prepare`), so its price is
    what `xlaopt analyze --layout` gives for the planned layout."""
    passes = [p for p in pipeline() if p.name != "layout-plan"]
    return run_pipeline(program, passes, ctx=PassContext.for_program(program, topology))[0]


def parse_pass_options(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`pass.field=value` strings (the CLI's `--pass-option`), typed by the pass's fields."""
    from xlaopt.models.registry import parse_assignments

    classes = {cls.name: cls for cls in pass_classes()}
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        target, sep, raw = item.partition("=")
        name, dot, field = target.strip().rpartition(".")
        if not sep or not dot:
            raise UserError(f"--pass-option {item!r}: expected PASS.FIELD=VALUE, e.g. "
                            f"--pass-option mesh-layout.constrain_activations=false")
        if name not in classes:
            raise UserError(f"--pass-option {item!r}: unknown pass {name!r}; passes are: {', '.join(classes)}")
        fields = {f.name: get_type_hints(classes[name])[f.name] for f in dataclasses.fields(classes[name]) if f.init}
        out.setdefault(name, {}).update(parse_assignments([f"{field}={raw}"], fields, "--pass-option",
                                                          f"{name} option", "mesh-layout.constrain_activations=false"))
    return out


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


def why_not(p: Pass, program: TrainProgram, ctx: PassContext) -> str | None:
    """Why the pipeline skips `p` for `program`: off unless enabled, or it does not fit."""
    return (p.off() if isinstance(p, OffUnlessEnabled) else None) or p.why_not(program, ctx)


def run_pipeline(program: TrainProgram, passes: Sequence[Pass], dump_dir: str | pathlib.Path | None = None,
                 ctx: PassContext | None = None) -> tuple[TrainProgram, list[PassRecord]]:
    ctx = ctx or PassContext.for_program(program)
    if ctx.target != program.target:
        raise UserError(f"the pipeline runs for target {ctx.target} but the program is built for {program.target}")
    records: list[PassRecord] = []
    if dump_dir is not None:
        _dump(program, program, pathlib.Path(dump_dir), 0, "input")
    for index, p in enumerate(passes, start=1):
        if not isinstance(p, Pass):
            raise PipelineError(f"{p!r} is not a pass: derive xlaopt.context.Pass (or OffUnlessEnabled)")
        if not _KEBAB.match(p.name):
            raise PipelineError(f"pass name {p.name!r} is not kebab-case")
        reason = why_not(p, program, ctx)
        if reason:  # the pass does not fit this program or target
            if p.name in ctx.requested:
                raise UserError(f"{p.name}: {reason}")
            records.append(PassRecord(p.name, False, {"skipped": reason}))
            continue
        result = _run_one(p, program, ctx, ran=", ".join(r.name for r in records) or "none")
        dumped = ()
        if dump_dir is not None and result.changed:  # an unchanged program's HLO is the last dump's
            dumped = _dump(program, result.program, pathlib.Path(dump_dir), index, p.name)
        records.append(PassRecord(p.name, result.changed, result.report, dumped))
        program = result.program
    return program, records


def _run_one(p: Pass, program: TrainProgram, ctx: PassContext, ran: str):
    """`p.run`, then every check of its result; a failure names the pass and those before it."""
    try:
        result = p.run(program, ctx)
    except UserError as e:
        raise type(e)(f"{p.name}: {e}") from e
    except Exception as e:
        raise PipelineError(f"pass {p.name!r} failed (passes run before it: {ran}): {e}") from e
    if result.program.target != ctx.target:
        raise PipelineError(f"pass {p.name!r} changed the target to {result.program.target} (passes run "
                            f"before it: {ran}); the target is the pipeline's, not a pass's")
    actually_changed = result.program != program
    if result.changed != actually_changed:
        raise PipelineError(f"pass {p.name!r} reported changed={result.changed} but the program "
                            f"{'did' if actually_changed else 'did not'} change (passes run before it: {ran})")
    problems = p.ensures(program, result.program, ctx) + violations(result.program, ctx)
    if problems:
        raise PipelineError(f"pass {p.name!r} returned a broken program (passes run before it: {ran}): "
                            f"{'; '.join(problems)}")
    return result


def _dump(before: TrainProgram, program: TrainProgram, dump_dir: pathlib.Path, index: int,
          name: str) -> tuple[str, ...]:
    """The program's diff from `before` (what the pass changed), its lowered and compiled HLO."""
    from xlaopt.compile import compile_program

    dump_dir.mkdir(parents=True, exist_ok=True)
    compiled = compile_program(program)
    stem = dump_dir / f"{index:02d}-{name}"
    diff_path = stem.with_suffix(".diff")
    lowered_path, compiled_path = stem.with_suffix(".lowered.mlir"), stem.with_suffix(".compiled.hlo")
    diff_path.write_text("\n".join(program_diff(before, program) or ["(the pipeline's input)"]) + "\n")
    lowered_path.write_text(compiled.lowered.as_text())
    compiled_path.write_text(compiled.train_step.as_text())
    return str(diff_path), str(lowered_path), str(compiled_path)


# What must hold of a program after every pass, beside each pass's own `ensures` (in the spirit of
# torch.fx's `run_checks` and XLA's HloVerifier). A violation is the pass's bug, not the user's: the
# pipeline names the pass and stops there, before a later pass or the compiler meets the program.
def _one_transform_per_kind(program: TrainProgram, ctx) -> list[str]:
    kinds = [type(t).__name__ for t in program.grad_transforms]
    doubled = sorted({k for k in kinds if kinds.count(k) > 1})
    return [f"grad transform {k} applied {kinds.count(k)} times" for k in doubled]


def _shardings_cover_the_state(program: TrainProgram, ctx) -> list[str]:
    """A layout names a spec for every state leaf and batch array of the program as it is now (a
    pass that changes the model, the settings or the execution must lay it out again)."""
    if program.shardings is None:
        return []
    import jax  # here, not at the top: `xlaopt passes` lists the pipeline without starting JAX
    from jax.sharding import PartitionSpec

    from xlaopt.step import batch_spec

    problems = []
    state = ctx.cache.abstract_state(program)
    specs = program.shardings.state
    if jax.tree.structure(state) != jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
        problems.append("the layout's state specs do not match the program's train state (lay it out again)")
    else:
        for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
            if len(spec) > leaf.ndim:
                problems.append(f"a spec {spec} has more entries than its {leaf.ndim}-d state leaf")
                break
    arrays = set(batch_spec(program))
    if set(program.shardings.batch) != arrays:
        problems.append(f"the layout's batch specs cover {sorted(program.shardings.batch)}, the batch holds "
                        f"{sorted(arrays)}")
    return problems


INVARIANTS = (_one_transform_per_kind, _shardings_cover_the_state)


def violations(program: TrainProgram, ctx) -> list[str]:
    return [problem for check in INVARIANTS for problem in check(program, ctx)]


def program_diff(before: TrainProgram, after: TrainProgram) -> list[str]:
    """One line per field of the program that differs: what the pass changed."""
    lines = []
    for field in dataclasses.fields(TrainProgram):
        old, new = getattr(before, field.name), getattr(after, field.name)
        if old == new:
            continue
        if field.name == "shardings":
            lines.append(f"shardings: {_shardings_change(old, new)}")
        elif field.name in ("grad_transforms", "hlo_transforms"):
            lines.append(f"{field.name}: [{', '.join(map(_short, old))}] -> [{', '.join(map(_short, new))}]")
        elif field.name == "compiler_options":
            changed = {k: v for k, v in dict(new).items() if dict(old).get(k, object()) != v}
            dropped = sorted(set(dict(old)) - set(dict(new)))
            lines.append(f"compiler_options: set {changed}" + (f", dropped {dropped}" if dropped else ""))
        elif dataclasses.is_dataclass(old) and type(old) is type(new):
            changes = [f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}" for f in dataclasses.fields(old)
                       if getattr(old, f.name) != getattr(new, f.name)]
            lines.append(f"{field.name}: {', '.join(changes)}")
        else:
            lines.append(f"{field.name}: {old!r} -> {new!r}")
    return lines


def _short(transform) -> str:
    return type(transform).__name__


def _shardings_change(old, new) -> str:
    if old is None or new is None:
        laid = new if old is None else old
        sharded = sum(any(s is not None for s in spec) for spec in laid.state_leaves)
        what = f"{len(laid.state_leaves)} state leaves ({sharded} sharded), batch {dict(laid.batch_items)}"
        return f"none -> {what}" if old is None else f"{what} -> none"
    if old.state_treedef != new.state_treedef:
        return "the state tree changed"
    moved = sum(a != b for a, b in zip(old.state_leaves, new.state_leaves))
    parts = [f"{moved} of {len(new.state_leaves)} state leaves resharded"]
    if old.batch_items != new.batch_items:
        parts.append(f"batch {dict(old.batch_items)} -> {dict(new.batch_items)}")
    if old.constrain_activations != new.constrain_activations:
        parts.append(f"constrain_activations {old.constrain_activations} -> {new.constrain_activations}")
    return ", ".join(parts)

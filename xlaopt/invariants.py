"""What must hold of a program after every pass, checked by the pipeline between passes (in the
spirit of torch.fx's `run_checks` and XLA's HloVerifier), beside each pass's own `ensures`; and
`program_diff`, what a pass changed, for dumps and failure messages.

A violation is the pass's bug, not the user's: the pipeline names the pass and stops there,
before a later pass or the compiler meets the broken program.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from xlaopt.program import TrainProgram


def _one_transform_per_kind(program: TrainProgram, ctx) -> list[str]:
    kinds = [type(t).__name__ for t in program.grad_transforms]
    doubled = sorted({k for k in kinds if kinds.count(k) > 1})
    return [f"grad transform {k} applied {kinds.count(k)} times" for k in doubled]


def _shardings_cover_the_state(program: TrainProgram, ctx) -> list[str]:
    """A layout names a spec for every state leaf and batch array of the program as it is now (a
    pass that changes the model, the settings or the execution must lay it out again)."""
    if program.shardings is None:
        return []
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

"""The one logical-to-mesh rule table, and its resolution into PartitionSpecs.

Rules are ordered (logical axis, mesh axes) pairs; for each array dimension the first
rule naming its logical axis whose mesh axes are not already used by that array wins.
Mesh axes of size 1 are dropped, so specs only name axes that actually split data.

Sequence parallelism (Megatron's, Korthikanti et al. 2022) is a choice of this table: the
residual stream between the attention and MLP sub-blocks (where the norms and residual adds run)
names its sequence `residual_seq`, which follows `seq` unless a rule says otherwise;
`with_sequence_parallel` splits it over `tensor` as well. The partitioner then turns each
sub-block's output all-reduce into a reduce-scatter onto the sequence shards and gathers the
normed input back before the next sub-block's projections, so every tensor rank runs the norms
and residual adds on 1/tensor of the tokens and keeps 1/tensor of the residual stream.

A program's questions about its layout are answered here too, so the passes and the loader ask
the rule table rather than the compiler: which mesh axes split its rows, and how many groups of
rows run on different devices.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from jax.sharding import PartitionSpec

from xlaopt.mesh import MESH_AXES, MeshError, MeshSpec

Rule = tuple[str, tuple[str, ...]]

DEFAULT_RULES: tuple[Rule, ...] = (
    # activations (rows over the pipeline's stages too: `xlaopt.models.pipeline`)
    ("batch", ("data", "fsdp", "stage")),
    # Rows where an earlier dimension took fsdp: the embedding's gradient, moved to the model
    # dimension's FSDP split before its scatter (`models.layers.embedding_lookup`).
    ("batch", ("data", "stage")),
    ("seq", ("context",)),
    ("residual_seq", ("context",)),  # `with_sequence_parallel` adds tensor
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    # parameters: pipeline stages split the layer stack, FSDP shards the model dimension, tensor
    # parallelism heads / mlp / vocab
    ("layers", ("stage",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
)


RESIDUAL_SEQ = "residual_seq"
TENSOR = "tensor"
# A logical axis no rule names follows another's rules (rule tables written before it existed).
_FOLLOWS = {RESIDUAL_SEQ: "seq"}


def with_sequence_parallel(rules: Sequence[Rule], on: bool = True) -> tuple[Rule, ...]:
    """The table with the residual stream's sequence split like `seq` and then over `tensor`
    (on), or like `seq` alone (off), in place of its own `residual_seq` rule."""
    seq = next((axes for logical, axes in rules if logical == "seq"), ())
    rule = (RESIDUAL_SEQ, tuple(a for a in seq if a != TENSOR) + ((TENSOR,) if on else ()))
    kept = [r for r in rules if r[0] != RESIDUAL_SEQ]
    at = next((i + 1 for i, (logical, _) in enumerate(kept) if logical == "seq"), 0)
    return tuple(kept[:at] + [rule] + kept[at:])


def sequence_parallel(rules: Sequence[Rule], mesh: MeshSpec) -> bool:
    """Whether the table splits the residual stream's sequence over tensor ranks of this mesh."""
    return mesh.size(TENSOR) > 1 and TENSOR in _rule_axes(RESIDUAL_SEQ, rules)


def _rule_axes(logical: str, rules: Sequence[Rule]) -> tuple[str, ...]:
    named = _named(logical, {r for r, _ in rules})
    return next((axes for r, axes in rules if r == named), ())


def _named(logical: str | None, named: set[str]) -> str | None:
    """The logical axis whose rules apply to `logical`: itself, or the one it follows (`_FOLLOWS`)
    where no rule names it."""
    return logical if logical in named else _FOLLOWS.get(logical, logical)


def validate_rules(rules: Sequence[Rule]) -> None:
    for logical, mesh_axes in rules:
        unknown = [a for a in mesh_axes if a not in MESH_AXES]
        if unknown:
            raise MeshError(f"rule {logical!r} -> {mesh_axes}: unknown mesh axes {unknown}; axes are {MESH_AXES}")


@dataclasses.dataclass
class RuleUse:
    """Which rules applied while resolving a set of arrays (for the layout report)."""
    applied: set = dataclasses.field(default_factory=set)

    def unused(self, rules: Sequence[Rule]) -> list[str]:
        """Rules for a logical axis no rule applied to (a fallback of one that did is not idle:
        activations, which this does not see, may need it)."""
        named = {logical for logical, _ in self.applied}
        return [f"{l} -> {','.join(m)}" for l, m in rules if l not in named]


def logical_to_spec(logical_axes: Iterable[str | None], shape: Sequence[int], rules: Sequence[Rule],
                    mesh: MeshSpec, what: str, use: RuleUse | None = None) -> PartitionSpec:
    """PartitionSpec for one array; raises MeshError naming `what` when an axis does not divide."""
    used: set[str] = set()
    out = []
    named = {logical for logical, _ in rules}
    for dim, (logical, size) in enumerate(zip(logical_axes, shape)):
        chosen: tuple[str, ...] = ()
        logical = _named(logical, named)
        for rule_logical, mesh_axes in rules:
            if rule_logical != logical or logical is None:
                continue
            if any(a in used for a in mesh_axes):
                continue
            chosen = tuple(a for a in mesh_axes if mesh.size(a) > 1)
            if use is not None:
                use.applied.add((rule_logical, mesh_axes))
            break
        ways = math.prod(mesh.size(a) for a in chosen)
        if size % ways:
            axes = ",".join(f"{a}={mesh.size(a)}" for a in chosen)
            raise MeshError(f"mesh {mesh}: {axes} does not divide dimension {dim} ({logical}, size {size}) of "
                            f"{what}; pick sizes for {'x'.join(chosen)} that divide {size}")
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names: none, one, or several."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def over_data(spec: PartitionSpec, shape: Sequence[int], mesh: MeshSpec) -> PartitionSpec:
    """`spec` with `data` added (innermost) to a dimension it divides: state every data replica
    would otherwise hold whole (the optimizer's, under `sharded_optimizer`). The first dimension
    nothing else splits, else the first whose split and `data` together divide it; unchanged where
    none does (a scalar, AdamW's count). Either way a replica's share lies inside the block of the
    weight its device holds and is sliced out where it is: with `data` outermost, XLA
    collective-permuted the gradients across the stages and replicas onto the split (calibration
    row R12: eight fp32 stacks, 0.44 s exposed). A dimension of its own first, so that a loop
    manual over data can hand each replica its share of the gradients itself (`data_scatter_specs`)."""
    ways = mesh.size("data")
    taken = {a for entry in spec for a in entry_axes(entry)}
    if ways <= 1 or "data" in taken:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    divides = [size % (ways * math.prod(mesh.size(a) for a in entry_axes(entry))) == 0
               for entry, size in zip(entries, shape)]
    dim = next((d for d, ok in enumerate(divides) if ok and not entry_axes(entries[d])),
               next((d for d, ok in enumerate(divides) if ok), None))
    if dim is None:
        return spec
    axes = entry_axes(entries[dim])
    entries[dim] = (*axes, "data") if axes else "data"
    while entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def data_scatter_specs(specs, params, mesh: MeshSpec):
    """For each of `params` (split as `specs`), its ZeRO-1 split (`over_data`) where a loop manual
    over `data` can hand each data replica its share of the gradient itself: `data` alone on a
    dimension. None where the gradient is left whole instead (no dimension divides, or another
    axis splits that dimension too: a loop's out spec would put data outside it)."""
    import jax

    def share(spec, param):
        target = over_data(spec, param.shape, mesh)
        return target if any(entry_axes(entry) == ("data",) for entry in target) else None

    return jax.tree.map(share, specs, params, is_leaf=lambda x: isinstance(x, PartitionSpec))


def mesh_axes_of(logical: str, size: int, rules: Sequence[Rule], mesh: MeshSpec, what: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) one dimension of logical axis `logical` and length `size` is
    split over."""
    spec = logical_to_spec((logical,), (size,), rules, mesh, what)
    return entry_axes(spec[0] if len(spec) else None)


def sequence_axes(rules: Sequence[Rule], mesh: MeshSpec) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the rule table splits a row's sequence over."""
    return tuple(a for logical, axes in rules if logical == "seq" for a in axes if mesh.size(a) > 1)


def batch_axes(program) -> tuple[str, ...]:
    """The mesh axes the program's layout splits the batch's rows over (none before a layout)."""
    if program.shardings is None:
        return ()
    return mesh_axes_of("batch", program.settings.batch.batch_size, program.rules, program.mesh, "the batch")


def head_axes(program) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the program's layout splits attention heads over."""
    if program.shardings is None:
        return ()
    return tuple(a for logical, axes in program.rules if logical == "act_heads" for a in axes
                 if program.mesh.size(a) > 1)


# Attentions whose work follows each row's samples: rows are balanced over the devices for them.
_ROW_COST_ATTENTION = ("segment", "cudnn")


def row_groups(program) -> int:
    """How many contiguous groups of a batch's rows run on different devices one after another
    (each micro-batch's share of each batch shard), for the loader to balance their attention
    work; 1 where every row costs the same (dense attention)."""
    if program.execution.attention not in _ROW_COST_ATTENTION:
        return 1
    return program.execution.micro_batches * math.prod(program.mesh.size(a) for a in batch_axes(program))

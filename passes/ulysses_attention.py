"""ulysses-attention: context parallel attention by all-to-all (`xlaopt.transforms.ulysses_attention`).

Where the context axis splits the sequence, every attention runs on whole rows with a share of
the heads instead of on a share of the rows with gathered keys and values: the all-to-alls carry
q, k, v and the output once each, split into head groups (`chunks`) that a GPU schedule can overlap
with the other groups' attention.

Fits where each tensor rank's query heads split over context; its key-value heads are repeated
where they do not (`ulysses_split`: chunks falls to 1 where 2 does not divide).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.context import Pass, PassContext, PassResult
from xlaopt.program import TrainProgram
from xlaopt.transforms.ulysses_attention import UlyssesAttentionTransform, ulysses_split

AXIS = "context"


def _seq_split(program: TrainProgram) -> bool:
    return any(logical == "seq" and AXIS in axes for logical, axes in program.rules)


@dataclasses.dataclass(frozen=True)
class UlyssesAttention(Pass):
    name: ClassVar[str] = "ulysses-attention"
    summary: ClassVar[str] = ("context parallel attention by all-to-all: whole rows, a share of the heads, in head "
                              "groups that overlap each other's all-to-alls")
    chunks: int = 2  # head groups; falls to 1 where the heads do not split into 2 groups

    def _split(self, program: TrainProgram) -> tuple[int, int] | None:
        m = program.model
        return ulysses_split(m.num_heads, m.num_kv_heads, program.mesh.size("tensor"), program.mesh.size(AXIS),
                             self.chunks)

    def why_not(self, program: TrainProgram, ctx: PassContext) -> str | None:
        if program.shardings is None:
            return "needs a layout (run mesh-layout first)"
        context = program.mesh.size(AXIS)
        if context == 1 or not _seq_split(program):
            return "no context parallelism (the rule table's seq is not split over a context axis of size > 1)"
        if self._split(program) is None:
            tensor = program.mesh.size("tensor")
            return (f"{program.model.num_heads // tensor} query heads and {program.model.num_kv_heads // tensor} "
                    f"key-value heads per tensor rank do not split over context={context}: each context rank needs "
                    f"whole heads (kv heads repeated at most within a query group)")
        return None

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        repeat, chunks = self._split(program)
        transform = UlyssesAttentionTransform(AXIS, chunks, repeat)
        new = program.with_grad_transform(transform)
        return PassResult(new, new != program, {"context": program.mesh.size(AXIS), "chunks": chunks,
                                                "kv_repeat": repeat})

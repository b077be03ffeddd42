"""ulysses-attention: context parallel attention by all-to-all (`xlaopt.transforms.ulysses_attention`).

Where the context axis splits the sequence, every attention runs on whole rows with a share of
the heads instead of on a share of the rows with gathered keys and values: the all-to-alls carry
q, k, v and the output once each, split into head groups (`chunks`) that a GPU schedule can overlap
with the other groups' attention.

Fits where each tensor rank's key-value heads split into context x chunks groups (chunks falls to
1 where 2 does not divide).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.context import Pass, PassContext, PassResult
from xlaopt.program import TrainProgram
from xlaopt.transforms.ulysses_attention import UlyssesAttentionTransform

AXIS = "context"


def _seq_split(program: TrainProgram) -> bool:
    return any(logical == "seq" and AXIS in axes for logical, axes in program.rules)


@dataclasses.dataclass(frozen=True)
class UlyssesAttention(Pass):
    name: ClassVar[str] = "ulysses-attention"
    summary: ClassVar[str] = ("context parallel attention by all-to-all: whole rows, a share of the heads, in head "
                              "groups that overlap each other's all-to-alls")
    chunks: int = 2  # head groups; falls to 1 where the heads do not split into 2 groups

    def _kv_heads_per_rank(self, program: TrainProgram) -> int:
        return program.model.num_kv_heads // program.mesh.size("tensor")

    def _chunks(self, program: TrainProgram) -> int:
        per_rank, context = self._kv_heads_per_rank(program), program.mesh.size(AXIS)
        return next((c for c in (self.chunks, 1) if per_rank % (context * c) == 0), 0)

    def why_not(self, program: TrainProgram, ctx: PassContext) -> str | None:
        if program.shardings is None:
            return "needs a layout (run mesh-layout first)"
        context = program.mesh.size(AXIS)
        if context == 1 or not _seq_split(program):
            return "no context parallelism (the rule table's seq is not split over a context axis of size > 1)"
        if not self._chunks(program):
            return (f"{self._kv_heads_per_rank(program)} key-value heads per tensor rank do not split over "
                    f"context={context}: each context rank needs whole heads")
        return None

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        chunks = self._chunks(program)
        transform = UlyssesAttentionTransform(AXIS, chunks)
        new = program.with_grad_transform(transform)
        return PassResult(new, new != program, {"context": program.mesh.size(AXIS), "chunks": chunks})

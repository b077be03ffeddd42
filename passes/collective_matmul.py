"""collective-matmul: tensor parallel's output projections as ppermute rings interleaved with
partial matmuls (`xlaopt.transforms.collective_matmul`), so the reduction over the tensor ranks
overlaps the matmul instead of following it.

Fits where the tensor axis splits the heads and the MLP (the rule table's `act_heads`, `act_mlp`
on `tensor`) and no axis splits the sequence (the ring cuts it into one chunk per rank).
Bidirectional by default: half of each chunk goes each way round the ring.

Off unless enabled (`--pass-option collective-matmul.enabled=true`): on XLA's own GPU schedule,
priced for H100s, it does not pay yet. For llama3-8b with tensor=4 on 8 rows of 8,192 tokens XLA's
async all-reduces under the latency-hiding scheduler already leave only 0.125 s of a 1.61 s step
exposed, and the ring's chunking adds more memory-bound work (slices, partial-gradient updates,
the sequence gathered back) than it hides: 2.15 s (BENCHMARKS.md, "Collective matmul").
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.context import OffUnlessEnabled, PassContext, PassResult
from xlaopt.program import TrainProgram
from xlaopt.transforms.collective_matmul import CollectiveMatmulTransform

AXIS = "tensor"


@dataclasses.dataclass(frozen=True)
class CollectiveMatmul(OffUnlessEnabled):
    name: ClassVar[str] = "collective-matmul"
    summary: ClassVar[str] = ("tensor parallel's output and MLP down projections as ppermute rings interleaved with "
                              "partial matmuls (bidirectional), so the reduction overlaps the matmul")
    off_because: ClassVar[str] = "on the priced GPU schedule it does not pay yet (see the pass's docstring)"
    bidirectional: bool = True

    def why_not(self, program: TrainProgram, ctx: PassContext) -> str | None:
        if program.shardings is None:
            return "needs a layout (run mesh-layout first)"
        if program.mesh.size(AXIS) == 1:
            return "no tensor parallelism (tensor=1): no matmul is reduced over tensor ranks"
        if program.execution.matmuls == "fp8":
            # Each chunk would be scaled by its own maximum, not the tensor's: other numbers.
            return "fp8 matmuls: the ring's chunks run in the compute dtype, not the tensor's fp8 scaling"
        schedule = program.pipeline_schedule
        if schedule is not None and schedule.name == "1f1b":
            # Checked by hand (2026-12-06): llama-tiny on stage=2,tensor=4 with the ring inside 1F1B's
            # conditionals gave other numbers than one device (the same loop with each branch
            # computed and selected gave the same): a collective-permute under a conditional that
            # only some devices take is matched across ticks by XLA:CPU's rendezvous.
            return ("1F1B runs each stage's layers under a conditional, and XLA:CPU matches the ring's sends "
                    "there across ticks (other numbers than one device)")
        rules = dict((logical, axes) for logical, axes in reversed(program.rules))  # first rule wins
        for logical in ("act_heads", "act_mlp"):
            if AXIS not in rules.get(logical, ()):
                return f"the rule table does not split {logical} over tensor"
        for logical, axes in program.rules:
            if logical == "seq" and any(program.mesh.size(a) > 1 for a in axes):
                return "the sequence is split (context parallel): the ring needs each row's whole sequence"
        return None

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        transform = CollectiveMatmulTransform(AXIS, program.mesh.size(AXIS), self.bidirectional)
        new = program.with_grad_transform(transform)
        return PassResult(new, new != program, {"ring": program.mesh.size(AXIS), "bidirectional": self.bidirectional})

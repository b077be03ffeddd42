"""layout-plan: choose the program's layout for the cluster (`xlaopt.planning`).

Off unless enabled (`xlaopt plan` enables it; `--pass-option layout-plan.enabled=true` lets
any command plan its own layout): the other commands run the layout they are given. Needs the
topology in the pass context. Replaces the mesh, device order, recomputation, micro-batches and
precision with the best candidate's; the report is the whole ranking (`xlaopt plan --json`).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from xlaopt.context import OffUnlessEnabled, PassContext, PassResult
from xlaopt.errors import UserError
from xlaopt.program import TrainProgram


@dataclasses.dataclass(frozen=True)
class LayoutPlan(OffUnlessEnabled):
    name: ClassVar[str] = "layout-plan"
    summary: ClassVar[str] = ("choose mesh, device order, remat, micro-batches and precision for the topology (off "
                              "unless enabled)")
    off_because: ClassVar[str] = "the other commands run the layout they are given (`xlaopt plan` enables it)"
    top: int = 2  # candidates compiled and priced from their schedule after the analytic ranking
    exhaustive: bool = False  # compile every candidate that fits
    mix: str = ""  # price rows packed from this sample mix (Cosmos 3); default: the synthetic stream
    data: str = ""  # or from this sample store
    remats: tuple[str, ...] = ()  # the recomputation policies planned over; (): the planner's (`space.REMATS`)
    precisions: tuple[str, ...] = ()  # `space.PRECISIONS` names planned over; (): every one the device runs
    stages: tuple[int, ...] = ()  # pipeline stage counts planned over; (): whole nodes a stage (`space.pipeline_stages`)

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        if ctx.topology is None:
            raise UserError("layout-plan needs a topology to plan for, e.g. --topology h100:16x8")
        from xlaopt.analysis.priced_batch import mix_batch, store_batch, synthetic_batch

        batch = (mix_batch(program, self.mix) if self.mix else store_batch(program, self.data) if self.data
                 else synthetic_batch(program))
        planned = self.plan_with(program, ctx, batch)
        return PassResult(planned["program"], planned["program"] != program, planned["report"])

    def plan_with(self, program: TrainProgram, ctx: PassContext, batch, prepare=None) -> dict:
        """The plan for `program` priced on `batch` (a `PricedBatch`): {program, layout, report, plan};
        `prepare` as `plan`'s (`xlaopt plan` gives the passes that follow this one)."""
        from xlaopt.planning.planner import plan
        from xlaopt.planning.report import plan_json

        kw = (({"remats": self.remats} if self.remats else {}) | ({"precisions": self.precisions} if self.precisions
                                                                  else {}) | ({"prepare": prepare} if prepare else {})
              | ({"stages": self.stages} if self.stages else {}))
        result = plan(program, ctx.topology, batch, top=self.top, exhaustive=self.exhaustive, **kw)
        report = dict(plan_json(result), data=batch.source)
        best = result.best.candidate
        return {"program": result.program_for(best), "layout": result.layout_for(best), "report": report,
                "plan": result}

"""`xlaopt calibrate`: price published training runs with the cost model."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of
from xlaopt.errors import UserError


@dataclasses.dataclass(frozen=True)
class CalibrateRequest:
    runs: str | None
    method: str
    target: str
    fit: bool
    json: str | None


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="price published training runs with the cost model; per-row and "
                                         "leave-one-out errors")
    p.add_argument("--runs", default=None, metavar="CSV|published|heldout",
                   help="published runs: a CSV, or a set shipped with xlaopt: published (default; the 11 the "
                        "efficiencies are fitted on, xlaopt/analysis/published_runs.csv) or heldout (11 from other "
                        "sources, never fitted on: priced with the frozen efficiencies, no leave-one-out); schema: "
                        "the columns, documented in docs/analysis.md")
    p.add_argument("--method", default="analytic", choices=("analytic", "compiled"),
                   help="analytic: every row from the analytic model (seconds); compiled: compile the rows xlaopt "
                        "can build (data/FSDP/tensor parallel, <= 512 devices, bf16) at full size on simulated CPU "
                        "devices and price the HLO with the simulator, the rest analytically (about a minute)")
    p.add_argument("--target", default="cpu", choices=("cpu", "gpu"),
                   help="what --method compiled compiles for: simulated CPU devices (default), or deviceless for "
                        "each row's GPUs, whole step, priced from XLA's GPU schedule (needs xlaopt[gpu-aot]; a "
                        "row it cannot build, e.g. A100's or a context split Ulysses cannot make, is priced "
                        "analytically and says why)")
    p.add_argument("--fit", action="store_true",
                   help="refit the efficiencies on the CSV's modelled rows, on the method's own prices (with "
                        "--method compiled: the compiled rows' simulated schedules), and print them to 3 "
                        "significant figures beside the frozen costmodel.FITTED (changes nothing)")
    p.add_argument("--json", default=None, metavar="OUT")


def main(args: argparse.Namespace) -> int:
    return run(request_of(CalibrateRequest, args))


def run(request: CalibrateRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.analysis.calibrate import PUBLISHED_RUNS, main_calibrate
    from xlaopt.analysis.calibrate_report import format_refit, format_table

    if request.target == "gpu" and request.method != "compiled":
        raise UserError("--target gpu is what --method compiled compiles for; add --method compiled")
    result = main_calibrate(request.runs or PUBLISHED_RUNS, request.json, method=request.method,
                            refit_only=request.fit, target=request.target)
    print(format_refit(result) if request.fit else format_table(result))
    return 0

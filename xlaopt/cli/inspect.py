"""`xlaopt inspect`: compile one step and list its collectives and memory (nothing runs)."""
from __future__ import annotations

import argparse

from xlaopt.cli import flags
from xlaopt.cli.requests import ProgramRequest, write_json


def register(sub) -> None:
    p = sub.add_parser("inspect", help="compile one step and list its collectives and memory (nothing runs)")
    flags.program_args(p, "bfloat16")
    p.add_argument("--topology", default=None, help="map collectives to link levels, e.g. h100:2x4 or a TOML/JSON file")


def main(args: argparse.Namespace) -> int:
    return run(ProgramRequest.of(args))


def run(request: ProgramRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.analysis.inspection import format_report, inspect_program
    from xlaopt.cli import programs

    program, _ = programs.program_on_devices(request)
    topology = programs.cluster(request, program)
    program, passes = programs.apply_pipeline(request, program, request.dump_hlo, topology)
    report = inspect_program(program, topology)
    print(format_report(report))
    write_json(request.json, dict(report, passes=passes))
    return 0

"""`xlaopt verify`: one gradient step sharded on the mesh against the same step on one device."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli import flags
from xlaopt.cli.requests import ProgramRequest, write_json


def register(sub) -> None:
    p = sub.add_parser("verify", help="one gradient step sharded on the mesh vs on one device")
    flags.program_args(p, "float32")
    p.add_argument("--topology", default=None, help=flags.CLUSTER_HELP)


def main(args: argparse.Namespace) -> int:
    return run(ProgramRequest.of(args))


def run(request: ProgramRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.cli import programs
    from xlaopt.runtime.verify import compare, one_step_grads, reference_program, tolerance_key

    program, _ = programs.program_on_devices(request)
    mesh = program.mesh
    topology = programs.cluster(request, program)
    sharded, passes = programs.apply_pipeline(request, program, request.dump_hlo, topology)
    single, _ = programs.apply_pipeline(request, reference_program(program), None, topology)
    dtype, reference_dtype = program.execution.compute_dtype, single.execution.compute_dtype
    result = compare(one_step_grads(sharded), one_step_grads(single), tolerance_key(program.execution))
    result.update(model=request.model, mesh=mesh.as_dict(), dtype=dtype, reference_dtype=reference_dtype,
                  execution=dataclasses.asdict(program.execution), passes=passes)
    against = "" if reference_dtype == dtype else f" against {reference_dtype} on one device"
    if program.execution.matmuls == "fp8":
        dtype += ", fp8 matmuls"
    print(f"verify {request.model} on {mesh} ({dtype}{against}): loss diff {result['max_abs_diff_loss']:.3g} "
          f"(tol {result['loss_tolerance']:.3g}), max grad rel diff {result['max_rel_diff_grads']:.3g} "
          f"at {result['worst_grad']} (tol {result['grad_tolerance']:.3g}): {'ok' if result['ok'] else 'MISMATCH'}")
    write_json(request.json, result)
    return 0 if result["ok"] else 1

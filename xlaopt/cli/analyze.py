"""`xlaopt analyze`: compile one step (or a serving step) from abstract parameters and price it
on a cluster topology."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli import flags
from xlaopt.cli.requests import GlobalBatch, ProgramRequest, RowSource, ServingRequest, request_of, write_json
from xlaopt.errors import UserError


@dataclasses.dataclass(frozen=True)
class AnalyzeRequest:
    program: ProgramRequest
    rows: RowSource
    global_batch: GlobalBatch
    target: str
    trace: str | None
    serving: ServingRequest


def register(sub) -> None:
    p = sub.add_parser("analyze", help="compile one step from abstract parameters and price it on a cluster "
                                       "topology: step time, MFU, exposed communication, memory")
    flags.program_args(p, "bfloat16")
    p.add_argument("--topology", required=True,
                   help="cluster to price on: PRESET:NODESxDEVICES (h100:16x8) or a TOML/JSON file")
    p.add_argument("--target", default="cpu", choices=("cpu", "gpu"),
                   help="compile with XLA's CPU pipeline on simulated devices (default), or deviceless for the "
                        "topology's GPUs (needs xlaopt[gpu-aot])")
    p.add_argument("--trace", default=None, metavar="OUT.json",
                   help="write the simulated timeline as a Chrome/Perfetto trace (ui.perfetto.dev)")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--mix", default=None, metavar="NAME",
                      help="price rows packed from this named sample mix as the loader packs them (cosmos3-480p, "
                           "cosmos3-mid, cosmos3-720p; rows default to the mix's budget); default: the synthetic stream")
    rows.add_argument("--data", default=None, metavar="DIR",
                      help="price rows packed from this sample store as the loader packs them (its index only)")
    p.add_argument("--skip-oversize", action="store_true",
                   help="with --mix/--data: leave out samples longer than a row, as `train --skip-oversize` does")
    flags.global_batch_args(p)
    flags.serving_args(p, "compiled, beside `plan --serve`'s analytic price")


def main(args: argparse.Namespace) -> int:
    return run(request_of(AnalyzeRequest, args, program=ProgramRequest.of(args),
                          rows=RowSource(args.data, args.mix, args.skip_oversize),
                          global_batch=GlobalBatch(args.global_batch, args.seq), serving=ServingRequest.of(args)))


def run(request: AnalyzeRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.cli import programs
    from xlaopt.mesh import request_cpu_devices

    asked = request.program
    topology = parse_topology(asked.topology)
    config = programs.config_of(asked.model, asked.overrides)
    given = programs.global_batch(programs.given_batch(asked), request.global_batch, config, request.rows.mix)
    layout = programs.layout_of(asked)
    if asked.layout is not None:
        layout.check_topology(topology.name, asked.layout)
    mesh = layout.mesh
    if mesh.num_devices > topology.num_devices:
        raise UserError(f"mesh {mesh} needs {mesh.num_devices} devices but topology {topology.name} has "
                        f"{topology.num_devices}; use a smaller mesh or a larger topology")
    if request.target == "cpu":
        request_cpu_devices(mesh.num_devices)  # one simulated device per mesh device (at most 512)
    else:
        import jax

        jax.config.update("jax_platforms", "cpu")  # the GPU compiler runs deviceless
    if request.serving.mode is not None:
        return _serving(request, config, layout, topology)
    return _training(request, config, layout, topology, given.over(layout.batch))


def _serving(request: AnalyzeRequest, config, layout, topology) -> int:
    from xlaopt.cli import programs
    from xlaopt.planning import serving_step

    given = request.program
    ignored = [flag for flag, value in (("--exec", given.execution_settings), ("--xla-option", given.xla_options),
                                        ("--pass-option", given.pass_options), ("--passes", given.passes),
                                        ("--disable", given.disable), ("--dump-hlo", given.dump_hlo),
                                        ("--trainable", given.trainable != "all")) if value]
    if ignored:  # none of them reaches a serving step: refused rather than silently dropped
        raise UserError(f"{', '.join(ignored)} with --serve: a serving step compiles as it is served, with no "
                        f"training passes, gradients or execution settings and XLA's default options; drop "
                        f"{'them' if len(ignored) > 1 else 'it'}")
    rows, dtype = request.global_batch.global_batch, programs.compute_dtype(request.program, layout)
    asked = request.serving
    if asked.mode == "decode":
        result = serving_step.analyze_decode(config, layout.mesh, layout.rules, topology, request.target,
                                             rows or 8, asked.context, dtype)
        print(serving_step.format_decode(result))
    elif asked.mode == "denoise":
        result = serving_step.analyze_denoise(config, layout.mesh, layout.rules, topology, request.target, rows or 1,
                                              asked.text_tokens, asked.gen_tokens, asked.denoise_guidance(), dtype)
        print(serving_step.format_denoise(result))
    else:
        from xlaopt.planning.serving_video_step import analyze_video, format_video_step

        if rows is not None:
            raise UserError("--global-batch with --serve video: a request is one clip (its guidance branches are "
                            "two rows); drop --global-batch")

        result = analyze_video(config, layout.mesh, layout.rules, topology, request.target, asked.profile(),
                               asked.prompt_cache, dtype)
        print(format_video_step(result))
    write_json(request.program.json, result)
    return 0


def _training(request: AnalyzeRequest, config, layout, topology, given) -> int:
    from xlaopt.analysis.analyze import analysis_batch_size, analyze, format_analysis
    from xlaopt.analysis.priced_batch import mix_batch, store_batch
    from xlaopt.cli import programs
    from xlaopt.data.batch import BatchShape
    from xlaopt.data.mixes import get_mix
    from xlaopt.families import family_of

    rows = request.rows
    default = family_of(config).default_batch(config)
    if rows.mix is not None:  # rows of the budget the mix is weighted for, unless given
        default = BatchShape(default.batch_size, *get_mix(rows.mix).row)
    batch = given.shape(default)
    batch = BatchShape(analysis_batch_size(layout.mesh, default.batch_size, given.batch_size),
                       batch.text_len, batch.gen_len)
    program = programs.program(request.program, config, layout, batch, target=request.target)
    program, passes = programs.apply_pipeline(request.program, program, None, topology)
    priced = (mix_batch(program, rows.mix, rows.skip_oversize) if rows.mix is not None
              else store_batch(program, rows.data, rows.skip_oversize) if rows.data is not None else None)
    result = analyze(program, topology, program.target, request.trace, request.program.dump_hlo, batch=priced)
    result["passes"] = passes
    print(format_analysis(result))
    write_json(request.program.json, result)
    return 0

"""`xlaopt plan`: choose the layout of a model on a cluster, for training or (analytically) serving."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli import flags
from xlaopt.cli.requests import GlobalBatch, RowSource, ServingRequest, request_of, write_json
from xlaopt.errors import UserError


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    model: str | None  # None: the --from layout's
    overrides: tuple[str, ...]
    topology: str
    global_batch: GlobalBatch
    rows: RowSource
    target: str
    top: int
    exhaustive: bool
    remat: str | None
    precision: str | None
    stages: str | None
    execution_settings: tuple[str, ...]
    from_layout: str | None
    out: str | None
    rows_shown: int
    seed: int
    trainable: str
    json: str | None
    mesh: str | None
    serving: ServingRequest


def register(sub) -> None:
    p = sub.add_parser("plan", help="choose the layout (mesh, device order, remat, micro-batches, precision) for a "
                                    "model on a cluster: analytic prices, the best few compiled; ranked with reasons")
    p.add_argument("--model", default=None, help="registered model name (default: the --from layout's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--topology", required=True, help="PRESET:NODESxDEVICES (h100:16x8, cpu:1x8) or a TOML/JSON file")
    flags.global_batch_args(p)
    flags.compile_cache_args(p)
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--mix", default=None, metavar="NAME",
                      help="Cosmos 3: price rows packed from this sample mix (default on GPUs: cosmos3-480p)")
    rows.add_argument("--data", default=None, metavar="DIR", help="Cosmos 3: price rows packed from this store")
    p.add_argument("--target", default="auto", choices=("auto", "cpu", "gpu"),
                   help="compile the best few for this target; auto: gpu for a GPU topology when xlaopt[gpu-aot] "
                        "is installed, else cpu (simulated devices, up to 512), else analytic prices only")
    p.add_argument("--top", type=int, default=2, metavar="K", help="compile and price the best K (default 2)")
    p.add_argument("--exhaustive", action="store_true", help="compile every candidate that fits (slow; for testing)")
    p.add_argument("--remat", default=None, metavar="POLICY[,POLICY...]",
                   help="the recomputation policies to plan over (xlaopt.models.remat names; default: none, "
                        "selective_megatron, minimal_with_context, dots, save_dot_with_context_except_mlp, "
                        "save_dot_except_mlp, save_qkv_proj, full); fewer plans faster")
    p.add_argument("--precision", default=None, metavar="NAME[,NAME...]",
                   help="the precisions to plan over: bfloat16, float16, fp8 (bf16 with the projections' matmuls in "
                        "fp8, on Hopper GPUs); default: every one the topology's device runs")
    p.add_argument("--stages", default=None, metavar="N[,N...]",
                   help="pipeline stage counts to plan over (default: those giving each stage whole nodes; 1: none)")
    p.add_argument("--exec", action="append", default=[], metavar="KEY=VALUE",
                   help="execution settings every candidate shares (attention, attention_block, layer_stack); remat, "
                        "micro_batches, compute_dtype and matmuls are what the planner chooses")
    p.add_argument("--from", dest="from_layout", default=None, metavar="OLD_LAYOUT",
                   help="re-plan: the layout a run was trained with; prints the resharding its state needs")
    p.add_argument("--out", default=None, metavar="LAYOUT.toml", help="write the best layout's file (TOML or JSON)")
    p.add_argument("--rows", type=int, default=12, help="candidates to print (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainable", default="all", metavar="SET",
                   help="plan training of this parameter set, the rest frozen (as train's --trainable; Cosmos 3: "
                        "generator)")
    p.add_argument("--json", default=None, metavar="OUT")
    flags.serving_args(p, "analytic")
    p.add_argument("--mesh", default=None,
                   help="with --serve video: price this layout instead of planning one (data: the guidance "
                        "branches first (cfg parallel), then replicas; context: Ulysses; tensor)")


def main(args: argparse.Namespace) -> int:
    return run(request_of(PlanRequest, args, overrides=args.set, global_batch=GlobalBatch(args.global_batch, args.seq),
                          rows=RowSource(args.data, args.mix), execution_settings=args.exec, rows_shown=args.rows,
                          serving=ServingRequest.of(args)))


def remats(given: str | None) -> tuple[str, ...]:
    """--remat's policies, each a priced policy of `xlaopt.models.remat`; () when not given."""
    if given is None:
        return ()
    from xlaopt.analysis.analytic import priced_recompute
    from xlaopt.models.remat import REMAT_POLICIES

    names = tuple(n.strip() for n in given.split(",") if n.strip())
    unknown = [n for n in names if n not in REMAT_POLICIES or not priced_recompute(n)]
    if unknown or not names:
        raise UserError(f"--remat {given!r}: {', '.join(unknown) or 'no policy'} is not a recomputation policy; "
                        f"policies: {', '.join(REMAT_POLICIES)}")
    return names


def _precisions(given: str | None) -> tuple[str, ...]:
    """--precision's names, each known; () when not given."""
    if given is None:
        return ()
    from xlaopt.planning.space import check_precisions

    try:
        return check_precisions(tuple(n.strip() for n in given.split(",") if n.strip()))
    except UserError as e:
        raise UserError(f"--{e}") from None


def _stages(given: str | None) -> tuple[int, ...]:
    """--stages's counts, each a positive integer; () when not given."""
    if given is None:
        return ()
    parts = [n.strip() for n in given.split(",") if n.strip()]
    if not parts or not all(n.isdigit() and int(n) > 0 for n in parts):
        raise UserError(f"--stages {given!r}: give positive stage counts separated by commas, e.g. --stages 1,2,4")
    return tuple(sorted({int(n) for n in parts}))


def run(request: PlanRequest) -> int:
    if request.mesh is not None and request.serving.mode != "video":
        raise UserError("--mesh fixes a video serving layout (--serve video); a training plan chooses the mesh")
    if request.serving.mode == "video":
        return _video(request)
    if request.serving.mode is not None:
        return _serving(request)
    policies = remats(request.remat)  # a bad name is refused before any work
    precisions = _precisions(request.precision)
    stage_counts = _stages(request.stages)
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.planning.defaults import prepare_devices

    prepare_devices(request.target, request.topology)
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.build import BatchRequest
    from xlaopt.cli import programs
    from xlaopt.context import PassContext
    from xlaopt.layout import load_layout
    from xlaopt.passes.layout_plan import LayoutPlan
    from xlaopt.pipeline import after_planning
    from xlaopt.planning.defaults import plan_program
    from xlaopt.planning.report import format_plan

    old = load_layout(request.from_layout) if request.from_layout is not None else None
    model = request.model if request.model is not None or old is None else old.model
    if model is None:
        raise UserError("--model is required (or --from a layout file that names its model)")
    if old is not None:
        old.check_model(model, request.from_layout)
    topology = parse_topology(request.topology)
    config = programs.config_of(model, request.overrides)
    given = programs.global_batch(BatchRequest(), request.global_batch, config, request.rows.mix)
    program, batch, target_note = plan_program(config, topology, target=request.target, mix=request.rows.mix,
                                               data=request.rows.data, batch=given,
                                               execution_settings=request.execution_settings, seed=request.seed,
                                               old=old, trainable=request.trainable)
    planner = LayoutPlan(enabled=True, top=request.top, exhaustive=request.exhaustive, remats=policies,
                         precisions=precisions, stages=stage_counts)
    result = planner.plan_with(program, PassContext.for_program(program, topology), batch, prepare=after_planning)
    report = result["report"]
    report["target_note"] = target_note
    print(format_plan(report, request.rows_shown))
    if target_note:
        print(f"note: {target_note}")
    if old is not None:
        from xlaopt.planning.replan import format_resharding, resharding

        moves = resharding(old, result["layout"], config)
        report["resharding"] = moves
        print(format_resharding(moves))
    if request.out:
        from xlaopt.layout import save_layout

        save_layout(result["layout"], request.out)
        print(f"best layout written to {request.out}")
    write_json(request.json, report)
    return 0


def _serving(request: PlanRequest) -> int:
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.cli import programs
    from xlaopt.layout import Layout, save_layout
    from xlaopt.planning import serving

    if request.model is None:
        raise UserError("--model is required")
    config = programs.config_of(request.model, request.overrides)
    topology = parse_topology(request.topology)
    asked, mode = request.serving, request.serving.mode
    rows = request.global_batch.global_batch or (8 if mode == "decode" else 1)
    if mode == "denoise" and asked.denoise_guidance() != 1.0:
        rows *= 2  # both guidance branches in one batch
    asked = serving.Request(mode, rows, asked.context, asked.text_tokens, asked.gen_tokens)
    ranked = serving.plan_serving(config, topology, asked)
    print(serving.format_serving(config, topology, asked, ranked))
    best = next((p for p in ranked if not p.reason), None)
    if best is None:
        raise UserError(f"no serving layout of {config.name} fits {topology.name}: "
                        f"{ranked[0].reason} at best; serve fewer rows or a shorter context, or on more devices")
    if request.out:
        save_layout(Layout(best.mesh, model=config.name, topology=topology.name), request.out)
        print(f"best layout written to {request.out}")
    write_json(request.json, {"model": config.name, "topology": topology.name, **serving.report(ranked, asked)})
    return 0


def _video(request: PlanRequest) -> int:
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.cli import programs
    from xlaopt.layout import Layout, save_layout
    from xlaopt.mesh import MeshSpec
    from xlaopt.planning import serving_video

    if request.model is None:
        raise UserError("--model is required")
    if request.global_batch.global_batch is not None:
        raise UserError("--global-batch with --serve video: a request is one clip, and data replicas serve more "
                        "of them at once (the table's videos a minute); drop --global-batch")
    config = programs.config_of(request.model, request.overrides)
    topology = parse_topology(request.topology)
    profile = request.serving.profile()
    fixed = None
    if request.mesh is not None:
        fixed = serving_video.layout_of_mesh(MeshSpec.parse(request.mesh), profile.guided)
        if fixed.mesh.num_devices > topology.num_devices:
            raise UserError(f"--mesh {request.mesh} needs {fixed.mesh.num_devices} devices but topology "
                            f"{topology.name} has {topology.num_devices}")
    ranked = serving_video.plan_video(config, topology, profile, request.serving.prompt_cache, fixed)
    print(serving_video.format_video(config, topology, profile, ranked, request.rows_shown))
    best = next((p for p in ranked if not p.reason), None)
    if best is None:
        raise UserError(f"no serving layout of {config.name} fits {topology.name}: {ranked[0].reason} at best; "
                        f"serve it on devices with more memory")
    if request.out:
        save_layout(Layout(best.layout.mesh, model=config.name, topology=topology.name), request.out)
        print(f"best layout written to {request.out}")
    write_json(request.json, {"model": config.name, "topology": topology.name,
                              **serving_video.report(config, profile, ranked)})
    return 0

"""Cosmos 3 fine-tuning with the reasoner frozen (`--trainable generator`, what NVIDIA's vision
fine-tuning trains) against training everything, on one node of 8 H100, rows of 45,056 tokens
from `cosmos3-720p` (one clip and its prompt a row), full recomputation, cuDNN attention, bf16.

    python experiments/frozen_reasoner.py [--json out/frozen_reasoner.json] [--models cosmos3-nano,cosmos3-super]
                                          [--no-compile]

For each model and trainable set: NVIDIA's fine-tuning layout (FSDP 4 x context 2, one row a
micro-batch; cosmos-framework `docs/training.md`) and the planner's best layout (analytic,
full recomputation, bf16, no stages), each priced by the analytic model with its memory parts,
and, with the `gpu-aot` extra, compiled for the GPU target after the passes and priced from XLA's
schedule with its compiled peak memory. Where no layout fits the planner says so and the layout
of least memory is shown instead.
"""
from __future__ import annotations

import argparse
import sys
import time

from layout_planner import base_program, write_json  # experiments/ is the script's path

TOPOLOGY, MIX = "h100:1x8", "cosmos3-720p"
RECIPE = dict(dp=1, fsdp=4, tp=1, cp=2, remat="full", micro_batches=2)  # 8 rows over 4 data ranks, one a micro-batch


def _priced(model: str, trainable: str):
    """(planner result or the UserError saying nothing fits, the recipe priced, the least-memory priced)."""
    import dataclasses

    from xlaopt.analysis.attention_work import batch_work
    from xlaopt.analysis.costmodel import efficiency_for
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.errors import UserError
    from xlaopt.mesh import MeshSpec
    from xlaopt.planning import planner
    from xlaopt.planning.price import price
    from xlaopt.planning.space import Candidate, enumerate_space

    topology = parse_topology(TOPOLOGY)
    program, batch = base_program(model, topology, MIX, None, None)
    program = program.replace(settings=dataclasses.replace(program.settings, trainable=trainable))
    work = batch_work(program.replace(mesh=MeshSpec()), batch.arrays)
    shape = planner._shape(program, work, batch)
    traced, _ = planner._traced_residuals(program, {("bfloat16", "compute")})
    eff = efficiency_for(topology)
    one = lambda c: planner.Priced(c, price(c, shape, program.settings.batch, topology, "gpu", False, eff,  # noqa: E731
                                            traced["bfloat16", "compute"]))
    space, _ = enumerate_space(program.model, program.settings.batch, topology.num_devices, topology.devices_per_node,
                               program.execution.attention, ("bfloat16",), (False, True), ("full",), (1,), "gpu")
    least = min((one(c) for c in space), key=lambda p: p.analytic.memory_bytes)
    try:
        result = planner.plan(program, topology, batch, top=0, remats=("full",), precisions=("bfloat16",), stages=(1,))
    except UserError as e:
        result = e
    return program, topology, batch, result, one(Candidate(**RECIPE)), least, work.model_flops


def _row(priced, model_flops, topology) -> dict:
    from xlaopt.analysis.simulate import mfu

    a = priced.analytic
    return {"candidate": str(priced.candidate), "analytic_step_s": a.step_time_s,
            "analytic_mfu": mfu(model_flops, a.step_time_s, topology, priced.candidate.num_devices, "bfloat16"),
            "memory_gib": a.memory_bytes / 2**30, "parts_gib": {k: v / 2**30 for k, v in a.memory_parts.items()}}


def _compiled(program, candidate, topology, batch) -> dict:
    from xlaopt.analysis.analyze import analyze
    from xlaopt.pipeline import after_planning
    from xlaopt.planning.planner import candidate_program

    t0 = time.perf_counter()
    r = analyze(after_planning(candidate_program(program, candidate), topology), topology, "gpu", batch=batch)
    return {"step_s": r["step_time_s"], "mfu": r["mfu"], "exposed_comm_s": r["exposed_comm_s"],
            "memory_gib": r["memory_per_device_bytes"]["peak_estimate"] / 2**30, "compile_s": time.perf_counter() - t0}


def run(model: str, trainable: str, compile_: bool) -> dict:
    program, topology, batch, result, recipe, least, flops = _priced(model, trainable)
    out = {"model": model, "trainable": trainable, "hbm_gib": topology.device.hbm_bytes / 2**30,
           "recipe": _row(recipe, flops, topology)}
    if isinstance(result, Exception):
        out["planned"], out["no_fit"] = None, str(result)
        out["least_memory"] = _row(least, flops, topology)
    else:
        out["planned"] = _row(result.best, flops, topology)
    if compile_:
        out["recipe"]["compiled"] = _compiled(program, recipe.candidate, topology, batch)
        if out["planned"] is not None:
            out["planned"]["compiled"] = _compiled(program, result.best.candidate, topology, batch)
    return out


def _print(r: dict) -> None:
    print(f"\n{r['model']}, trainable {r['trainable']} ({TOPOLOGY}, {MIX} rows, HBM {r['hbm_gib']:.1f} GiB)")
    for label in ("recipe", "planned", "least_memory"):
        row = r.get(label)
        if not row:
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in row["parts_gib"].items())
        line = (f"  {label:<13} {row['candidate']:<44} analytic {row['analytic_step_s']:7.2f} s "
                f"(MFU {row['analytic_mfu']:.1%}), {row['memory_gib']:6.1f} GiB [{parts}]")
        if "compiled" in row:
            c = row["compiled"]
            line += f"\n  {'':<13} compiled for the GPU: {c['step_s']:.2f} s (MFU {c['mfu']:.1%}), {c['memory_gib']:.1f} GiB"
        print(line)
    if r.get("no_fit"):
        print(f"  planner: {r['no_fit']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default="cosmos3-nano,cosmos3-super")
    ap.add_argument("--no-compile", action="store_true", help="analytic prices only")
    args = ap.parse_args()
    from xlaopt.analysis import gpu_aot

    compile_ = not args.no_compile and gpu_aot.available()
    if not args.no_compile and not compile_:
        print("note: without the gpu-aot extra, analytic prices only", file=sys.stderr)
    rows = []
    for model in args.models.split(","):
        for trainable in ("all", "generator"):
            rows.append(run(model, trainable, compile_ and model == "cosmos3-nano"))
            _print(rows[-1])
    if args.json:
        write_json({"topology": TOPOLOGY, "mix": MIX, "recipe": RECIPE, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

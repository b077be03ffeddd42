"""Issue 29's figures: a pipeline layout on XLA's GPU schedule, the planner with stages on
llama3-405b, and Cosmos 3 context parallel through Ulysses and cuDNN.

    python experiments/large_jobs.py [--json out/large_jobs.json] [--only bubble,planner,nano_cp,mid_rows]

bubble    llama3-8b on two stages of one 8-GPU node each (h100:2x8, stage=2 x tensor=8 with
          sequence parallelism), full recomputation, cuDNN attention, rows of 4,096, compiled
          deviceless and priced from XLA's schedule for M = 2, 4, 8 micro-batches of 8 rows (the
          global batch 8 M, so every tick runs the same program). The bubble as priced is P - 1
          ticks, a tick's time read from the simulated schedule (the tick loops' time over their
          trips, `analyze`'s `pipeline.tick_s`); the schedule's theoretical bubble is P - 1 times
          a micro-batch through one stage without a pipeline: the same 8 rows through 16 layers
          (`num_layers=16`) on one node, its layer loops' time from the same simulator. Beside
          them, the step fitted as c + M s on M = 2 and 4 and the held-out M = 8, and each
          stage-to-stage send's window (the compute XLA places between its start and its done).
          Then M = 4 and 8 with V = 2 virtual stages (each stage's 16 layers in two chunks, a
          micro-batch twice round the ring): the theoretical bubble (P - 1) / V of the reference.
          Then M = 4 and 8 with the 1F1B schedule (forward and backward in one loop, the head and
          loss on the last stage in its ticks): the theoretical bubble GPipe's; its memory beside.
planner   `plan` of llama3-405b on 512 H100 (64 x 8), 256 sequences of 8,192, analytic: the best
          layout for each stage count tried, with the reasons.
nano_cp   cosmos3-nano on 16 x 8 H100, 720p rows: the planner's best layout with context
          parallel and without, each compiled for the GPU target after the passes (Ulysses on
          cuDNN: no segment loop in the HLO) and priced from its schedule.
mid_rows  cosmos3-super and cosmos3-nano on rows of 74,000 (cosmos3-mid), 8 x 8 H100: the least
          memory per device without context parallel and the planned layout that fits.

Needs the `gpu-aot` extra (jax-cuda12-plugin). About 15-60 s a compile on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from layout_planner import write_json  # experiments/ is the script's path

BUBBLE_MODEL, BUBBLE_TOPOLOGY, BUBBLE_MESH, ROWS_PER_MICRO_BATCH, SEQ = "llama3-8b", "h100:2x8", "stage=2,tensor=8", 8, 4096
STAGE_MESH, STAGE_TOPOLOGY = "tensor=8", "h100:1x8"  # one stage of BUBBLE_MESH, unpipelined


def _analyze(model, mesh, topology, batch, execution, sequence_parallel=False, dump=None, overrides=None):
    """(the program after the pass pipeline, its `analyze` result) on deviceless GPUs."""
    import xlaopt.api as api
    from xlaopt.analysis.analyze import analyze
    from xlaopt.analysis.topology import parse_topology

    program = api.build_program(model, mesh, batch=batch, execution=execution, target="gpu",
                                sequence_parallel=sequence_parallel, overrides=overrides)
    program, _ = api.optimize(program, topology=topology)
    return program, analyze(program, parse_topology(topology), dump_dir=dump)


def _stage_reference_s() -> float:
    """One micro-batch (8 rows) forward and backward through one stage's 16 layers, unpipelined:
    the layer loops' time (a loop XLA peeled iterations off is scaled to all 16 layers)."""
    layers = 16
    _, r = _analyze(BUBBLE_MODEL, STAGE_MESH, STAGE_TOPOLOGY, (ROWS_PER_MICRO_BATCH, SEQ, 0),
                    {"remat": "full", "attention": "cudnn"}, sequence_parallel=True, overrides={"num_layers": layers})
    loops = [loop for loop in r["schedule"]["loops"] if loop.get("ops") and loop["trip_count"] >= layers - 2]
    return sum(loop["time_s"] * layers / loop["trip_count"] for loop in loops)


def bubble() -> dict:
    import tempfile

    from xlaopt.analysis.hlo import compute_inside_async

    P, rows = 2, []
    reference = _stage_reference_s()
    only = set(filter(None, os.environ.get("BUBBLE_ROWS", "").split(";")))  # e.g. "4,1,1f1b;8,1,1f1b"
    for M, V, schedule in ((2, 1, "gpipe"), (4, 1, "gpipe"), (8, 1, "gpipe"), (4, 2, "gpipe"), (8, 2, "gpipe"),
                           (4, 1, "1f1b"), (8, 1, "1f1b"), (4, 2, "1f1b"), (8, 2, "1f1b")):
        if only and f"{M},{V},{schedule}" not in only:
            continue
        with tempfile.TemporaryDirectory() as dump:
            execution = {"layer_stack": "pipeline", "remat": "full", "attention": "cudnn", "pipeline_microbatches": M,
                         "pipeline_virtual_stages": V, "pipeline_schedule": schedule}
            _, r = _analyze(BUBBLE_MODEL, BUBBLE_MESH, BUBBLE_TOPOLOGY, (ROWS_PER_MICRO_BATCH * M, SEQ, 0),
                            execution, sequence_parallel=True, dump=dump)
            with open(f"{dump}/analyzed-gpu.compiled.hlo") as f:
                windows = compute_inside_async(f.read(), "collective-permute")
        p = r["pipeline"]
        rows.append({"schedule": schedule, "microbatches": M, "virtual_stages": V, "ticks": p["ticks"],
                     "step_time_s": r["step_time_s"],
                     "tick_s": p["tick_s"], "bubble_priced_s": p["bubble_s"], "bubble_theory_s": (P - 1) * reference / V,
                     "bubble_error": p["bubble_s"] / ((P - 1) * reference / V) - 1,
                     "bubble_fraction_of_step": p["bubble_fraction_of_step"],
                     "exposed_comm_s": r["exposed_comm_s"], "stage_exposed_s": r["exposed_comm_by_axis_s"].get("stage", 0.0),
                     "send_windows": windows, "memory_gib": r["memory_per_device_bytes"]["peak_estimate"] / 2**30})
    fitted = [r for r in rows if r["schedule"] == "gpipe" and r["virtual_stages"] == 1]
    if len(fitted) < 3:
        fitted = []
    (m2, s2), (m4, s4) = ((r["microbatches"], r["step_time_s"]) for r in fitted[:2]) if fitted else ((2, 0), (4, 0))
    slope = (s4 - s2) / (m4 - m2)
    for r in fitted:
        r["fitted_step_s"] = s2 + (r["microbatches"] - m2) * slope
        r["step_error"] = r["step_time_s"] / r["fitted_step_s"] - 1
    return {"model": BUBBLE_MODEL, "topology": BUBBLE_TOPOLOGY, "mesh": BUBBLE_MESH + " (sequence parallel)",
            "rows_per_micro_batch": ROWS_PER_MICRO_BATCH, "seq": SEQ, "stage_reference_s": reference, "rows": rows}


def planner_405b() -> dict:
    import xlaopt.api as api
    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.planning.planner import plan
    from xlaopt.planning.report import plan_json

    program = api.build_program("llama3-405b", "", batch=(256, 8192, 0), execution={"attention": "cudnn"}, target="gpu")
    result = plan(program, parse_topology("h100:64x8"), synthetic_batch(program), top=0)
    report = plan_json(result)
    return {"best": report["best"]["candidate"], "step_time_s": report["best"]["step_time_s"],
            "mfu": report["best"]["mfu"], "by_stages": report["by_stages"], "counts": report["counts"],
            "nemo_layout": _nemo_405b(result)}


def _nemo_405b(result) -> dict:
    """NVIDIA's Llama 3.1 405B layout on H100 (calibration row N11: tensor 8, pipeline 8 with 8
    virtual stages (interleaved 1F1B), context 2, fp8, no recomputation) on this job's 512 GPUs
    and 256 sequences (data 4), priced by the same analytic model as Megatron runs it."""
    import dataclasses

    from xlaopt.analysis import analytic
    from xlaopt.analysis.calibrate import HELDOUT_RUNS, prepare, read_runs
    from xlaopt.analysis.costmodel import efficiency_for
    from xlaopt.analysis.simulate import mfu

    priced = prepare(next(r for r in read_runs(HELDOUT_RUNS) if r.id == "N11"))
    layout = dataclasses.replace(priced.run.layout, dp=4, global_batch=256)
    topology = result.topology
    step = analytic.price_step(priced.run.shape, layout, topology, priced.software, efficiency_for(topology))
    return {"layout": f"dp=4 tp=8 pp=8 (8 virtual stages) cp=2 micro_batch=1 ({layout.micro_batches:g} micro-batches) "
                      f"no recompute fp8, {priced.run.framework}",
            "step_time_s": step.step_time_s, "mfu": mfu(result.model_flops, step.step_time_s, topology, 512, "bfloat16"),
            "breakdown": dataclasses.asdict(step)}


def _planned(model: str, topology_spec: str, mix: str, **plan_options):
    """The analytic plan of `model` on `topology_spec` over rows of `mix` (one per GPU), cuDNN."""
    from layout_planner import base_program

    from xlaopt.analysis.topology import parse_topology
    from xlaopt.planning.planner import plan

    topology = parse_topology(topology_spec)
    program, batch = base_program(model, topology, mix, None, None)
    return plan(program, topology, batch, top=0, stages=(1,), **plan_options), topology, batch


def _compiled(result, candidate, topology, batch) -> dict:
    """A planned candidate after the passes that follow the planner, compiled for the GPU target
    and priced from its schedule: what `xlaopt plan` compiles."""
    import tempfile

    from xlaopt.analysis.analyze import analyze
    from xlaopt.models.segment_attention import loop_tag
    from xlaopt.pipeline import after_planning

    program = after_planning(result.program_for(candidate), topology)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        r = analyze(program, topology, "gpu", batch=batch, dump_dir=dump)
        with open(f"{dump}/analyzed-gpu.compiled.hlo") as f:
            segment_loop = loop_tag(1, 1).split("_L")[0] in f.read()
    return {"candidate": str(candidate), "transforms": [t.name for t in program.grad_transforms],
            "step_time_s": r["step_time_s"], "mfu": r["mfu"], "exposed_comm_s": r["exposed_comm_s"],
            "memory_gib": r["memory_per_device_bytes"]["peak_estimate"] / 2**30, "segment_loop_in_hlo": segment_loop,
            "analytic_step_time_s": next(p.analytic.step_time_s for p in result.ranked if p.candidate == candidate),
            "seconds": time.perf_counter() - t0}


def nano_cp(tries: int = 3) -> dict:
    """cosmos3-nano on 16 x 8 H100, 720p rows: the best layout with context parallel and the best
    without, by the analytic plan (bf16), each compiled; down each ranking (one candidate per
    mesh) until a compiled step fits the HBM, at most `tries` compiles each."""
    result, topology, batch = _planned("cosmos3-nano", "h100:16x8", "cosmos3-720p", precisions=("bfloat16",))
    hbm = topology.device.hbm_bytes / 2**30
    out = {"best": str(result.best.candidate), "hbm_gib": hbm}
    for label, wanted in (("with_context", lambda c: c.cp > 1), ("without_context", lambda c: c.cp == 1)):
        seen, compiled = set(), []
        for p in result.ranked:
            c = p.candidate
            if not wanted(c) or c.mesh in seen:
                continue
            seen.add(c.mesh)
            compiled.append(_compiled(result, c, topology, batch))
            if compiled[-1]["memory_gib"] <= hbm or len(compiled) == tries:
                break
        out[label] = compiled
    return out


def mid_rows(model: str = "cosmos3-super", topology_spec: str = "h100:4x8") -> dict:
    """Rows of 74,000 (cosmos3-mid), full recomputation, bf16: the least memory a layout needs
    where one device holds whole rows and heads (no tensor or context parallel), and the plan."""
    result, _, _ = _planned(model, topology_spec, "cosmos3-mid", remats=("full",), precisions=("bfloat16",))
    whole = [p for p in result.ranked + result.unfit if p.candidate.tp == 1 and p.candidate.cp == 1]
    least = min(whole, key=lambda p: p.analytic.memory_bytes)
    best_cp = next((p for p in result.ranked if p.candidate.cp > 1), None)
    row = lambda p: {"candidate": str(p.candidate), "memory_gib": p.analytic.memory_bytes / 2**30,  # noqa: E731
                     "parts_gib": {k: v / 2**30 for k, v in p.analytic.memory_parts.items()},
                     "step_time_s": p.analytic.step_time_s}
    return {"model": model, "topology": topology_spec, "hbm_gib": result.topology.device.hbm_bytes / 2**30,
            "whole_rows_least": row(least), "planned": row(result.best),
            "planned_with_context": row(best_cp) if best_cp else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="bubble,planner", help="sections to run, comma-separated")
    args = ap.parse_args()
    from xlaopt.analysis import gpu_aot

    if not gpu_aot.available():
        print("needs the gpu-aot extra: pip install -e '.[gpu-aot]'", file=sys.stderr)
        return 2
    out = {}
    sections = set(args.only.split(","))
    if "bubble" in sections:
        out["bubble"] = b = bubble()
        print(f"{b['model']} on {b['topology']}, {b['mesh']}, {b['rows_per_micro_batch']} rows of {b['seq']:,} a "
              f"micro-batch; one micro-batch through a stage unpipelined: {b['stage_reference_s'] * 1e3:.1f} ms")
        print(f"{'schedule':>9}{'M':>3}{'V':>3}{'ticks':>7}{'step s':>9}{'bubble ms':>11}{'theory ms':>11}{'error':>8}{'of step':>9}"
              f"{'fit s':>8}{'error':>8}{'send windows':>15}{'GiB':>7}")
        for r in b["rows"]:
            fit = f"{r['fitted_step_s']:>8.3f}{r['step_error']:>+8.1%}" if "fitted_step_s" in r else f"{'':>16}"
            print(f"{r['schedule']:>9}{r['microbatches']:>3}{r['virtual_stages']:>3}{r['ticks']:>7}{r['step_time_s']:>9.3f}"
                  f"{r['bubble_priced_s'] * 1e3:>11.1f}{r['bubble_theory_s'] * 1e3:>11.1f}{r['bubble_error']:>+8.1%}"
                  f"{r['bubble_fraction_of_step']:>9.1%}{fit}{str(r['send_windows']):>15}{r['memory_gib']:>7.1f}")
    if "planner" in sections:
        out["planner"] = p = planner_405b()
        print(f"\nllama3-405b on h100:64x8, 256 x 8,192, analytic: best {p['best']} {p['step_time_s']:.3f} s, "
              f"MFU {p['mfu']:.1%}")
        n = p["nemo_layout"]
        print(f"  NVIDIA's layout (row N11) on this job, Megatron's schedule: {n['layout']}: {n['step_time_s']:.3f} s, "
              f"MFU {n['mfu']:.1%} (bubble {n['breakdown']['pipeline_bubble_s']:.3f} s)")
        for row in p["by_stages"]:
            print(f"  {row['stages']:>2} stage(s): " + (f"#{row['rank']} {row['candidate']}, {row['step_time_s']:.3f} s: "
                                                       f"{row['reason']}" if row["rank"] else row["reason"]))
    if "nano_cp" in sections:
        out["nano_cp"] = n = nano_cp()
        print(f"\ncosmos3-nano on h100:16x8, 720p rows, bf16: analytic best {n['best']}")
        for label in ("with_context", "without_context"):
            for c in n[label]:
                print(f"  {label:<16} {c['candidate']:<56} compiled {c['step_time_s']:8.3f} s (analytic "
                      f"{c['analytic_step_time_s']:.3f}), {c['memory_gib']:.1f} GiB of {n['hbm_gib']:.1f}, transforms "
                      f"{c['transforms']}, segment loop in the HLO: {c['segment_loop_in_hlo']}")
    if "mid_rows" in sections:
        out["mid_rows"] = m = mid_rows()
        print(f"\n{m['model']} on {m['topology']}, rows of 74,000, full recomputation, bf16 (HBM {m['hbm_gib']:.1f} GiB)")
        for label in ("whole_rows_least", "planned", "planned_with_context"):
            c = m[label]
            if c:
                parts = ", ".join(f"{k} {v:.1f}" for k, v in c["parts_gib"].items())
                print(f"  {label:<22} {c['candidate']:<50} {c['memory_gib']:6.1f} GiB ({parts}), {c['step_time_s']:.2f} s")
    if args.json:
        write_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

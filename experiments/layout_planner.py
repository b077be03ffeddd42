"""The layout planner against an exhaustive search of the same space, and against the pure-FSDP
baseline, on the issue's (model, topology, batch) cases; and its ranking checked on the one
cluster we can measure (this machine's 8 simulated CPU devices).

    python experiments/layout_planner.py [--cases NAME,...] [--exhaustive-max N] [--json out/layout_planner.json]
    python experiments/layout_planner.py --cpu-ranking [--steps 6] [--json out/layout_planner_cpu.json]

Per case: `plan` as `xlaopt plan` runs it (analytic ranking, the best 2 diverse candidates and the
baseline compiled for the GPU target and priced from their schedule), then `--exhaustive` over
the same space (every candidate that fits compiled; skipped where more than --exhaustive-max fit,
and said so). Reported: planning seconds, the planner's best and the exhaustive best (compiled
step times), their ratio, the baseline's, and the chosen layout's analytic memory against its
compiled `memory_analysis()`.

`--cpu-ranking`: plan cosmos3-tiny for cpu:1x8 (measured host efficiencies) with its best 6 (one
per mesh family and remat policy) compiled on the simulated devices and priced from their
schedule, train those 6 for real (median step time over --steps after the first), and report
Kendall's tau between the measured order and the predicted one, compiled and analytic.

Needs the `gpu-aot` extra for the GPU cases. Expected on a 2-core machine: ~40-120 s a plan;
exhaustive ~15-25 s per candidate compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CASES = {  # name -> (model, topology, mix or None, global batch or None (one row per GPU), seq)
    "nano-720p-1x8": ("cosmos3-nano", "h100:1x8", "cosmos3-720p", None, None),
    "nano-720p-16x8": ("cosmos3-nano", "h100:16x8", "cosmos3-720p", None, None),
    "nano-720p-128x8": ("cosmos3-nano", "h100:128x8", "cosmos3-720p", None, None),
    "super-720p-1x8": ("cosmos3-super", "h100:1x8", "cosmos3-720p", None, None),
    "super-720p-16x8": ("cosmos3-super", "h100:16x8", "cosmos3-720p", None, None),
    "super-720p-128x8": ("cosmos3-super", "h100:128x8", "cosmos3-720p", None, None),
    "nano-480p-16x8": ("cosmos3-nano", "h100:16x8", "cosmos3-480p", None, None),
    "super-480p-16x8": ("cosmos3-super", "h100:16x8", "cosmos3-480p", None, None),
    "nano-480p-128x8": ("cosmos3-nano", "h100:128x8", "cosmos3-480p", None, None),
    "llama3-70b-16x8": ("llama3-70b", "h100:16x8", None, 512, 8192),
}


def base_program(model: str, topology, mix: str | None, global_batch: int | None, seq: int | None):
    from xlaopt.analysis.priced_batch import mix_batch, synthetic_batch
    from xlaopt.data.batch import BatchShape
    from xlaopt.data.mixes import get_mix
    from xlaopt.execution import ExecutionConfig
    from xlaopt.models.registry import get_config
    from xlaopt.program import TrainProgram, TrainSettings

    rows = global_batch or topology.num_devices
    batch = BatchShape(rows, *get_mix(mix).row) if mix else BatchShape(rows, seq, 0)
    program = TrainProgram(get_config(model), settings=TrainSettings(batch=batch),
                           execution=ExecutionConfig(attention="cudnn"), target="gpu")
    return program, (mix_batch(program, mix) if mix else synthetic_batch(program))


def plan_choice(model: str, topology_spec: str, rows: int, seq: int, **plan_options) -> dict:
    """The planner's choice for `model` on a GPU topology, its candidates compiled for the GPU
    target after the passes that follow it (as `xlaopt plan` runs), as JSON-ready data."""
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.pipeline import after_planning
    from xlaopt.planning.planner import plan

    topology = parse_topology(topology_spec)
    program, batch = base_program(model, topology, None, rows, seq)
    p = plan(program, topology, batch, prepare=after_planning, **plan_options)
    best = p.best
    return {"best": str(best.candidate), "kind": best.candidate.kind, "method": best.method,
            "step_time_s": best.step_time_s, "mfu": p.mfu(best), "memory_bytes": best.memory_bytes,
            "plan_seconds": p.seconds, "space": len(p.ranked) + len(p.unfit) + len(p.rejected),
            "compiled": [{"candidate": str(c.candidate), "step_time_s": c.step_time_s,
                          "analytic_step_time_s": c.analytic.step_time_s, "reason": c.reason}
                         for c in p.ranked + p.unfit if c.compiled is not None]}


def print_plan_choice(label: str, r: dict) -> None:
    """One `plan_choice` result: the best layout, then each compiled candidate."""
    print(f"  {label} {r['space']:>6} candidates, best {r['best']}: {r['step_time_s']:.2f} s ({r['method']}), "
          f"MFU {r['mfu']:.1%} (of the bf16 peak), plan {r['plan_seconds']:.0f} s")
    for c in r["compiled"]:
        print(f"      {c['candidate']:<62} compiled {c['step_time_s']:6.2f} s  analytic "
              f"{c['analytic_step_time_s']:6.2f} s  {c['reason']}")


def write_json(out: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {path}")


def run_case(name: str, exhaustive_max: int, precisions: tuple[str, ...] | None = None) -> dict:
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.errors import UserError
    from xlaopt.planning.planner import plan

    model, topo, mix, rows, seq = CASES[name]
    topology = parse_topology(topo)
    program, batch = base_program(model, topology, mix, rows, seq)
    out = {"case": name, "model": model, "topology": topo, "data": batch.source,
           "global_batch": program.settings.batch.batch_size,
           "row_tokens": program.settings.batch.text_len + program.settings.batch.gen_len}
    kw = {} if precisions is None else {"precisions": precisions}
    out["precisions"] = list(precisions) if precisions else "all"
    try:
        planned = plan(program, topology, batch, **kw)
    except UserError as e:
        return dict(out, error=str(e))
    best = planned.best
    out.update(plan_seconds=planned.seconds, fit=len(planned.ranked), method=planned.method,
               best=str(best.candidate), best_step_s=best.step_time_s, best_method=best.method,
               best_mfu=planned.mfu(best),
               best_memory_compiled_gib=best.memory_bytes / 2**30,
               best_memory_analytic_gib=best.analytic.memory_bytes / 2**30,
               baseline=str(planned.baseline.candidate) if planned.baseline else None,
               baseline_step_s=planned.baseline.step_time_s if planned.baseline else None,
               baseline_method=planned.baseline.method if planned.baseline else None)
    out["speedup_over_baseline"] = (out["baseline_step_s"] / best.step_time_s) if planned.baseline else None
    if len(planned.ranked) > exhaustive_max:
        out["exhaustive"] = f"skipped: {len(planned.ranked)} candidates fit (> --exhaustive-max {exhaustive_max})"
        return out
    t0 = time.perf_counter()
    full = plan(program, topology, batch, exhaustive=True, **kw)
    out.update(exhaustive_seconds=time.perf_counter() - t0, exhaustive_best=str(full.best.candidate),
               exhaustive_best_step_s=full.best.step_time_s,
               planner_over_exhaustive=best.step_time_s / full.best.step_time_s,
               exhaustive_ranking=[(str(p.candidate), p.step_time_s, p.analytic.step_time_s)
                                   for p in full.ranked if p.compiled is not None])
    return out


def kendall_tau(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += ((a[i] > a[j]) - (a[i] < a[j])) * ((b[i] > b[j]) - (b[i] < b[j]))
    return s / (n * (n - 1) / 2)


def cpu_ranking(steps: int, top: int = 6) -> dict:
    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.context import PassContext
    from xlaopt.data.batch import BatchShape
    from xlaopt.models.registry import get_config
    from xlaopt.passes.mesh_layout import MeshLayout
    from xlaopt.planning.planner import plan
    from xlaopt.program import TrainProgram, TrainSettings
    from xlaopt.runtime.train import train

    topology = parse_topology("cpu:1x8")
    program = TrainProgram(get_config("cosmos3-tiny"), settings=TrainSettings(batch=BatchShape(16, 48, 112)))
    planned = plan(program, topology, synthetic_batch(program), top=top)  # the top 6 compiled and simulated
    chosen = [p for p in planned.ranked if p.compiled is not None][:top]
    rows = []
    for p in chosen:
        candidate_program = planned.program_for(p.candidate)
        candidate_program = MeshLayout().run(candidate_program, PassContext.for_program(candidate_program)).program
        result = train(candidate_program, steps)
        times = [s["step_time_s"] for s in result["steps"][1:]]
        rows.append({"candidate": str(p.candidate), "predicted_analytic_s": p.analytic.step_time_s,
                     "predicted_compiled_s": p.step_time_s, "measured_median_s": statistics.median(times),
                     "measured_s": times})
        print(f"  {rows[-1]['candidate']:<50} predicted {p.analytic.step_time_s:.3f} s analytic, "
              f"{p.step_time_s:.3f} s compiled; measured {rows[-1]['measured_median_s']:.3f} s", flush=True)
    measured = [r["measured_median_s"] for r in rows]
    return {"model": "cosmos3-tiny", "topology": "cpu:1x8", "batch": [16, 48, 112], "steps": steps, "rows": rows,
            "kendall_tau_compiled": kendall_tau([r["predicted_compiled_s"] for r in rows], measured),
            "kendall_tau_analytic": kendall_tau([r["predicted_analytic_s"] for r in rows], measured)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--exhaustive-max", type=int, default=80)
    parser.add_argument("--precisions", default=None,
                        help="restrict the space (planner and exhaustive alike), e.g. bfloat16: fp16 candidates "
                             "price as their bf16 twins, so an exhaustive run over both compiles each twice")
    parser.add_argument("--cpu-ranking", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import jax

    if args.cpu_ranking:
        from xlaopt.mesh import request_cpu_devices

        request_cpu_devices(8)
        result = cpu_ranking(args.steps)
        print(f"Kendall tau, predicted vs measured order of the top {len(result['rows'])}: compiled prices "
              f"{result['kendall_tau_compiled']:.2f}, analytic prices {result['kendall_tau_analytic']:.2f}")
    else:
        jax.config.update("jax_platforms", "cpu")
        rows = []
        print(f"{'case':<18}{'fit':>5}{'plan s':>8}{'best (planner)':>48}{'step s':>8}{'exh. best':>48}"
              f"{'ratio':>7}{'vs FSDP':>8}{'mem an/comp GiB':>17}")
        for name in args.cases.split(","):
            r = run_case(name, args.exhaustive_max, tuple(args.precisions.split(",")) if args.precisions else None)
            rows.append(r)
            if "error" in r:
                print(f"{name:<18} error: {r['error']}", flush=True)
                continue
            ratio = f"{r['planner_over_exhaustive']:.3f}" if "planner_over_exhaustive" in r else "-"
            print(f"{name:<18}{r['fit']:>5}{r['plan_seconds']:>8.1f}{r['best']:>48}{r['best_step_s']:>8.2f}"
                  f"{r.get('exhaustive_best', '-'):>48}{ratio:>7}{r['speedup_over_baseline'] or 0:>8.3f}"
                  f"{r['best_memory_analytic_gib']:>8.1f}/{r['best_memory_compiled_gib']:<8.1f}", flush=True)
            if args.json:  # written as it goes: a long run keeps what it finished
                with open(args.json, "w") as f:
                    json.dump({"cases": rows, "machine": os.uname().nodename, "cpus": os.cpu_count()}, f, indent=2)
        result = {"cases": rows}
    if args.json:
        result.update(machine=os.uname().nodename, cpus=os.cpu_count(),
                      date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

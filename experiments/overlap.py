"""The overlap passes on XLA's own GPU schedule: each case's planned layout compiled deviceless for
the GPU target and priced by the calibrated simulator, side by side without the overlap passes,
with the flags pass alone (MaxText's way) and with every overlap pass the pipeline applies.

    python experiments/overlap.py [--cases NAME,...] [--json out/overlap.json]

Per case the layout is the planner's choice (`xlaopt plan`'s ranking, compiled without overlap
passes), then each variant runs the pipeline with that layout and `analyze` prices it. Reported:
step time, exposed communication and its share of the step, exposed gradient synchronisation
(reductions over the batch axes), the step's matmul FLOPs over the model's (XLA's loop
transformations change what the schedule holds), and the ratios against "none".

Needs the `gpu-aot` extra. Expected on a 2-core machine: ~1 minute a plan, ~30 s a variant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from layout_planner import CASES, base_program  # noqa: E402  (the planner benchmark's cases and rows)

DEFAULT_CASES = ("nano-720p-16x8", "llama3-70b-16x8")
VARIANTS = {  # name -> (the passes run (None: the whole default pipeline, the planner aside), pass options)
    "none": (("mesh-layout",), {}),
    "flags": (("mesh-layout", "overlap-flags"), {}),
    # XLA's loop double buffering (off by default: it also unrolls the micro-batch loop), measured apart.
    "flags-db": (("mesh-layout", "overlap-flags"), {"overlap-flags": {"double_buffering": True}}),
    "all": (None, {}),
}


def run_case(name: str) -> dict:
    from xlaopt.analysis.analyze import analyze
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.context import PassContext
    from xlaopt.pipeline import pipeline, run_pipeline, select_passes
    from xlaopt.planning.planner import plan

    model, topo, mix, rows, seq = CASES[name]
    topology = parse_topology(topo)
    program, batch = base_program(model, topology, mix, rows, seq)
    planned = plan(program, topology, batch, precisions=("bfloat16",))
    layout_program = planned.program_for(planned.best.candidate)
    out = {"case": name, "model": model, "topology": topo, "layout": str(planned.best.candidate),
           "plan_seconds": planned.seconds, "variants": {}}
    for variant, (only, options) in VARIANTS.items():
        t0 = time.perf_counter()
        passes = select_passes(pipeline(options), only=only, disable=() if only else ("layout-plan",))
        p, records = run_pipeline(layout_program, passes, ctx=PassContext.for_program(layout_program, topology))
        r = analyze(p, topology, batch=batch)
        out["variants"][variant] = {
            "passes": [x.name for x in records if x.changed], "step_time_s": r["step_time_s"], "mfu": r["mfu"],
            "exposed_comm_s": r["exposed_comm_s"], "exposed_grad_sync_s": r["exposed_grad_sync_s"],
            "grad_sync_s": r["grad_sync_s"], "comm_s": r["comm_s"],
            "exposed_share": r["exposed_comm_s"] / r["step_time_s"],
            "hlo_flops_over_model_flops": r["hlo_flops_over_model_flops"], "seconds": time.perf_counter() - t0}
    base = out["variants"]["none"]
    for v in out["variants"].values():
        v["speedup"] = base["step_time_s"] / v["step_time_s"]
        v["grad_sync_exposed_reduction"] = (base["exposed_grad_sync_s"] / v["exposed_grad_sync_s"]
                                            if v["exposed_grad_sync_s"] > 0 else float("inf"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")  # the GPU compiler runs deviceless
    from xlaopt.analysis import gpu_aot

    if not gpu_aot.available():
        print("needs the gpu-aot extra: pip install -e '.[gpu-aot]'", file=sys.stderr)
        return 2
    rows = []
    print(f"{'case':<18}{'layout':>46}{'variant':>12}{'step s':>9}{'exposed s':>11}{'share':>7}"
          f"{'grad sync exp. s':>18}{'vs none':>9}{'grad sync /':>12}{'hlo/model':>10}")
    for name in args.cases.split(","):
        r = run_case(name)
        rows.append(r)
        for variant, v in r["variants"].items():
            print(f"{name:<18}{r['layout']:>46}{variant:>12}{v['step_time_s']:>9.3f}{v['exposed_comm_s']:>11.3f}"
                  f"{v['exposed_share'] * 100:>6.1f}%{v['exposed_grad_sync_s']:>18.4f}{v['speedup']:>9.3f}"
                  f"{v['grad_sync_exposed_reduction']:>12.2f}{v['hlo_flops_over_model_flops']:>10.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": rows, "machine": os.uname().nodename, "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sequence parallelism under tensor parallel: llama3-70b on 16 x 8 H100, priced with and without.

    python experiments/sequence_parallel.py [--json out/sequence_parallel.json] [--skip-plan | --plan-only]

1. `verify` with the residual stream split over the tensor ranks, on tensor=2 and
   data=2,tensor=2, for llama-tiny and cosmos3-tiny (simulated CPU devices, float32).
2. One layout (fsdp=16, tensor=8, remat full, 8 micro-batches of 512 x 8,192 tokens) compiled
   deviceless for H100s and priced from XLA's schedule, without and with sequence parallelism,
   with XLA's pipelined collectives (the overlap-flags pass's default) and without them: the
   compute (norms and residual adds on 1/8 of the tokens), the exposed communication, the peak
   memory; beside each, the analytic price.
3. The planner's choice for the same model, cluster and batch with the new dimensions
   (sequence parallelism, the named recomputation policies, fp8 matmuls) and without them (none,
   dots, full; bf16 and fp16).

Needs the `gpu-aot` extra (jax-cuda12-plugin) for 2 and 3. About 1 minute per compile on 2 cores.
"""
from __future__ import annotations

import argparse
import sys
import time

from layout_planner import plan_choice, print_plan_choice, write_json  # experiments/ is the script's path

MODEL, TOPOLOGY, ROWS, SEQ = "llama3-70b", "h100:16x8", 512, 8192
LAYOUT = "fsdp=16,tensor=8"
EXECUTION = {"remat": "full", "micro_batches": 8}


def verify_rows() -> list[dict]:
    import xlaopt.api as api

    rows = []
    for model in ("llama-tiny", "cosmos3-tiny"):
        for mesh in ("tensor=2", "data=2,tensor=2"):
            program = api.build_program(model, mesh, overrides={"num_layers": 2}, sequence_parallel=True,
                                        execution={"compute_dtype": "float32"})
            program, _ = api.optimize(program)
            result = api.verify(program)
            rows.append({"model": model, "mesh": mesh, "ok": result["ok"], "loss_diff": result["max_abs_diff_loss"],
                         "grad_rel_diff": result["max_rel_diff_grads"]})
    return rows


def priced_layout(sequence_parallel: bool, pipelined: bool) -> dict:
    import xlaopt.api as api
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.planning.price import price
    from xlaopt.planning.shapes import analytic_shape
    from xlaopt.planning.space import Candidate

    program = api.build_program(MODEL, LAYOUT, batch=(ROWS, SEQ, 0), execution={**EXECUTION, "attention": "cudnn"},
                                target="gpu", sequence_parallel=sequence_parallel)
    options = {} if pipelined else {"overlap-flags": {"pipelined_collectives": False}}
    program, _ = api.optimize(program, topology=TOPOLOGY, options=options)
    t0 = time.perf_counter()
    result = api.analyze(program, TOPOLOGY)
    topology = parse_topology(TOPOLOGY)
    candidate = Candidate(1, 16, 8, 1, "full", 8, "bfloat16", sequence_parallel)
    analytic = price(candidate, analytic_shape(program.model, 1.0), program.settings.batch, topology, "gpu", False)
    return {"sequence_parallel": sequence_parallel, "pipelined_collectives": pipelined,
            "step_time_s": result["step_time_s"], "mfu": result["mfu"], "compute_s": result["compute_s"],
            "exposed_comm_s": result["exposed_comm_s"], "tensor_comm_s": result["comm_by_axis"].get("tensor", {}).get("time_s"),
            "peak_memory_bytes": result["memory_per_device_bytes"]["peak_estimate"],
            "hlo_flops_over_model_flops": result["hlo_flops_over_model_flops"], "analytic_step_time_s": analytic.step_time_s,
            "analytic_memory_bytes": analytic.memory_bytes, "seconds": time.perf_counter() - t0}


def planned(new_dimensions: bool) -> dict:
    old = {} if new_dimensions else {"sequence_parallel": (False,), "remats": ("none", "dots", "full"),
                                     "precisions": ("bfloat16", "float16")}
    return {"new_dimensions": new_dimensions, **plan_choice(MODEL, TOPOLOGY, ROWS, SEQ, **old)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="out/sequence_parallel.json")
    ap.add_argument("--skip-plan", action="store_true", help="only verify and the fixed layout")
    ap.add_argument("--plan-only", action="store_true", help="only the planner's choices (part 3)")
    args = ap.parse_args()
    import xlaopt.api as api

    api.simulated_devices(4)
    out: dict = {} if args.plan_only else {"verify": verify_rows()}
    print("verify with --sequence-parallel (float32 against one device):" if "verify" in out else "")
    for r in out.get("verify", ()):
        print(f"  {r['model']:<13} {r['mesh']:<16} loss diff {r['loss_diff']:.2e}  grad rel diff "
              f"{r['grad_rel_diff']:.2e}  {'ok' if r['ok'] else 'FAILED'}")
    from xlaopt.analysis import gpu_aot

    if not gpu_aot.available():
        print("the GPU-target parts need xlaopt[gpu-aot]; stopping here")
        return 0
    out["layout"] = [] if args.plan_only else [priced_layout(sp, pipelined) for pipelined in (True, False)
                                                for sp in (False, True)]
    if out["layout"]:
        print(f"\n{MODEL} on {TOPOLOGY}, {LAYOUT}, remat full, 8 micro-batches of {ROWS} x {SEQ} (GPU target, priced):")
        print(f"  {'SP':<4}{'pipelined':<11}{'step s':>9}{'MFU':>8}{'compute s':>11}{'exposed s':>11}"
              f"{'tensor comm s':>15}{'peak GiB':>10}{'analytic s':>12}{'analytic GiB':>14}")
    for r in out["layout"]:
        print(f"  {'on' if r['sequence_parallel'] else 'off':<4}{'yes' if r['pipelined_collectives'] else 'no':<11}"
              f"{r['step_time_s']:>9.2f}{r['mfu']:>8.1%}{r['compute_s']:>11.2f}{r['exposed_comm_s']:>11.2f}"
              f"{r['tensor_comm_s'] or 0:>15.2f}{r['peak_memory_bytes'] / 2**30:>10.1f}"
              f"{r['analytic_step_time_s']:>12.2f}{r['analytic_memory_bytes'] / 2**30:>14.1f}")
    if not args.skip_plan:
        out["plan"] = [planned(new) for new in (False, True)]
        print(f"\nthe planner's choice for {MODEL} on {TOPOLOGY}, {ROWS} x {SEQ} (compiled for the GPU target):")
        for r in out["plan"]:
            print_plan_choice(f"{'with SP, named policies, fp8' if r['new_dimensions'] else 'without them':<29}", r)
    write_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

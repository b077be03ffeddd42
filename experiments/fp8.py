"""fp8 matmuls: llama3-8b on 8 H100, priced in bf16 and with the projections in fp8.

    python experiments/fp8.py [--json out/fp8.json] [--skip-plan]

1. `verify` with `matmuls=fp8` on tensor=2 and data=2,tensor=2 for llama-tiny and cosmos3-tiny
   (simulated CPU devices, float32 compute, against the same fp8 program on one device).
2. One layout, Megatron-Bridge's published fp8 run of this model (R14 in
   xlaopt/analysis/published_runs.csv: fsdp=8, 128 rows of 8,192 tokens, micro-batches of one
   row), compiled deviceless for H100s and priced from XLA's schedule, under two recomputation
   policies, in bf16 and in fp8: the step, its compute and exposed communication, the fp8 GEMMs
   in the HLO, the peak memory; beside each, the analytic price. The speedup is bf16's step over
   fp8's.
3. The planner's choice for the same model, cluster and batch with fp8 in its precision
   dimension and without it.

Needs the `gpu-aot` extra (jax-cuda12-plugin) for 2 and 3. About 20 s per compile on 2 cores.
"""
from __future__ import annotations

import argparse
import sys
import time

from layout_planner import plan_choice, print_plan_choice, write_json  # experiments/ is the script's path

MODEL, TOPOLOGY, ROWS, SEQ, MICRO_BATCHES = "llama3-8b", "h100:1x8", 128, 8192, 16
LAYOUT = "fsdp=8"
REMATS = ("full", "selective_megatron")


def verify_rows() -> list[dict]:
    import xlaopt.api as api

    rows = []
    for model in ("llama-tiny", "cosmos3-tiny"):
        for mesh in ("tensor=2", "data=2,tensor=2"):
            program = api.build_program(model, mesh, overrides={"num_layers": 2},
                                        execution={"compute_dtype": "float32", "matmuls": "fp8"})
            program, _ = api.optimize(program)
            result = api.verify(program)
            rows.append({"model": model, "mesh": mesh, "ok": result["ok"], "loss_diff": result["max_abs_diff_loss"],
                         "grad_rel_diff": result["max_rel_diff_grads"], "grad_tolerance": result["grad_tolerance"]})
    return rows


def priced_layout(remat: str, matmuls: str) -> dict:
    import xlaopt.api as api
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.planning.price import price
    from xlaopt.planning.shapes import analytic_shape
    from xlaopt.planning.space import Candidate

    execution = {"remat": remat, "micro_batches": MICRO_BATCHES, "attention": "cudnn", "matmuls": matmuls}
    program = api.build_program(MODEL, LAYOUT, batch=(ROWS, SEQ, 0), execution=execution, target="gpu")
    program, _ = api.optimize(program, topology=TOPOLOGY)
    t0 = time.perf_counter()
    result = api.analyze(program, TOPOLOGY)
    topology = parse_topology(TOPOLOGY)
    candidate = Candidate(1, 8, 1, 1, remat, MICRO_BATCHES, "bfloat16", matmuls=matmuls)
    analytic = price(candidate, analytic_shape(program.model, 1.0), program.settings.batch, topology, "gpu", False)
    return {"remat": remat, "matmuls": matmuls, "step_time_s": result["step_time_s"],
            "tokens_per_s_per_gpu": ROWS * SEQ / result["step_time_s"] / topology.num_devices,
            "compute_s": result["compute_s"], "exposed_comm_s": result["exposed_comm_s"],
            "peak_memory_bytes": result["memory_per_device_bytes"]["peak_estimate"],
            "fp8_gemms": result["fp8_gemms"],
            "analytic_step_time_s": analytic.step_time_s, "analytic_memory_bytes": analytic.memory_bytes,
            "seconds": time.perf_counter() - t0}


def planned(fp8: bool) -> dict:
    precisions = ("bfloat16", "float16", "fp8") if fp8 else ("bfloat16", "float16")
    return {"fp8": fp8, **plan_choice(MODEL, TOPOLOGY, ROWS, SEQ, precisions=precisions)}


def _print_layouts(rows: list[dict]) -> None:
    print(f"\n{MODEL} on {TOPOLOGY}, {LAYOUT}, {MICRO_BATCHES} micro-batches of {ROWS // MICRO_BATCHES // 8} x {SEQ} "
          f"per device (GPU target, priced):")
    print(f"  {'remat':<20}{'matmuls':<9}{'step s':>8}{'tok/s/GPU':>11}{'compute s':>11}{'exposed s':>11}"
          f"{'fp8 GEMMs':>11}{'peak GiB':>10}{'analytic s':>12}{'analytic GiB':>14}")
    for r in rows:
        print(f"  {r['remat']:<20}{r['matmuls']:<9}{r['step_time_s']:>8.2f}{r['tokens_per_s_per_gpu']:>11,.0f}"
              f"{r['compute_s']:>11.2f}{r['exposed_comm_s']:>11.2f}{r['fp8_gemms']:>11}"
              f"{r['peak_memory_bytes'] / 2**30:>10.1f}{r['analytic_step_time_s']:>12.2f}"
              f"{r['analytic_memory_bytes'] / 2**30:>14.1f}")
    for remat in REMATS:
        bf16, fp8 = (next(r for r in rows if r["remat"] == remat and r["matmuls"] == m) for m in ("compute", "fp8"))
        print(f"  fp8 speedup, remat {remat}: compiled {bf16['step_time_s'] / fp8['step_time_s']:.3f}x, "
              f"analytic {bf16['analytic_step_time_s'] / fp8['analytic_step_time_s']:.3f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="out/fp8.json")
    ap.add_argument("--skip-plan", action="store_true", help="only verify and the fixed layout")
    args = ap.parse_args()
    import xlaopt.api as api

    api.simulated_devices(4)
    out: dict = {"verify": verify_rows()}
    print("verify with matmuls=fp8 (float32 compute, against the same fp8 program on one device):")
    for r in out["verify"]:
        print(f"  {r['model']:<13} {r['mesh']:<16} loss diff {r['loss_diff']:.2e}  grad rel diff "
              f"{r['grad_rel_diff']:.3f} (tol {r['grad_tolerance']:.3f})  {'ok' if r['ok'] else 'FAILED'}")
    from xlaopt.analysis import gpu_aot

    if not gpu_aot.available():
        print("the GPU-target parts need xlaopt[gpu-aot]; stopping here")
        return 0
    out["layout"] = [priced_layout(remat, m) for remat in REMATS for m in ("compute", "fp8")]
    _print_layouts(out["layout"])
    if not args.skip_plan:
        out["plan"] = [planned(fp8) for fp8 in (False, True)]
        print(f"\nthe planner's choice for {MODEL} on {TOPOLOGY}, {ROWS} x {SEQ} (compiled for the GPU target):")
        for r in out["plan"]:
            print_plan_choice(f"{'with fp8' if r['fp8'] else 'without fp8':<12}", r)
    write_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

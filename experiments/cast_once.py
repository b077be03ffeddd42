"""Weights cast once a step (`xlaopt.transforms.cast_once`) against cast at every micro-batch; with
`--setting weights_work_once`, the rest of the weights' own work once a step
(`xlaopt.transforms.weights_once`: fp8's quantization and transposes) against at every micro-batch.

    python experiments/cast_once.py [--setting cast_weights_once] [--json out/cast_once.json] [--steps 10]

1. On this machine's CPU: llama-tiny (4 layers, d_model 512) on one device, bf16, 64 rows of 256
   tokens in 8 micro-batches; the step run `--steps` times after a warm-up under each setting,
   the median step time and the compiled step's temporary memory; the loss and gradient norm of
   the first step, which must be equal.
2. On XLA's GPU schedule (deviceless, the `gpu-aot` extra): Llama 3 8B on 8 H100 as two published
   runs laid it out, Megatron-Bridge's fsdp=8 (R14: 16 micro-batches of one 8,192-token row per
   device) in bf16 and fp8, and NeMo's data=4 x context=2 (R11: 32 micro-batches), priced by the
   simulator at the fitted efficiencies: the step, its compute, the peak memory. Without
   recomputation, each compiled twice: with XLA's memory-pressure rematerialization (its
   default), which clones GEMMs to bring a step near the HBM's size under its limit, and without
   it (as MaxText's GPU scripts run), so that a difference in what that pass chose to recompute is
   told apart from one in the step. R14's fp8 layout also with full recomputation and Megatron's
   selective, as `experiments/fp8.py` prices it.
Each row is the step with the execution `--setting` off and on, the other settings at their
defaults.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from layout_planner import write_json  # experiments/ is the script's path

CPU_MODEL = ("llama-tiny", {"num_layers": 4, "d_model": 512, "mlp_dim": 1536, "num_heads": 8, "num_kv_heads": 4})
CPU_BATCH, CPU_MICRO_BATCHES = (64, 256, 0), 8
GPU_MODEL, TOPOLOGY, ROWS, SEQ = "llama3-8b", "h100:1x8", 128, 8192
# (mesh, micro-batches, matmuls, recomputation): R14's and R11's layouts without recomputation, and
# R14's with the two policies `experiments/fp8.py` prices it under.
GPU_LAYOUTS = (("fsdp=8", 16, "compute", "none"), ("fsdp=8", 16, "fp8", "none"), ("data=4,context=2", 32, "fp8", "none"),
               ("fsdp=8", 16, "fp8", "full"), ("fsdp=8", 16, "fp8", "selective_megatron"))


SETTINGS = ("cast_weights_once", "weights_work_once")


def cpu_row(setting: str, once: bool, steps: int) -> dict:
    import jax

    import xlaopt.api as api
    from xlaopt.analysis.analyze import memory_of
    from xlaopt.compile import compile_program
    from xlaopt.families import family_of

    name, overrides = CPU_MODEL
    program = api.build_program(name, "data=1", overrides=overrides, batch=CPU_BATCH,
                                execution={"compute_dtype": "bfloat16", "micro_batches": CPU_MICRO_BATCHES,
                                           setting: once})
    compiled = compile_program(program)
    state = compiled.init(jax.random.key(0))
    batch = compiled.put_batch(family_of(program.model).synthetic(program.model, program.settings.batch, 0).batch(0))
    state, metrics = compiled.train_step(state, batch, jax.random.key(1))
    first = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled.train_step(state, batch, jax.random.key(2 + i))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return {setting: once, "median_step_s": statistics.median(times), "steps": steps,
            "temp_bytes": memory_of(compiled.train_step)["temp"], **first}


def gpu_row(mesh: str, micro_batches: int, matmuls: str, remat: str, setting: str, once: bool,
            remat_pass: bool) -> dict:
    import xlaopt.api as api

    execution = {"micro_batches": micro_batches, "attention": "cudnn", "matmuls": matmuls, "remat": remat,
                 setting: once}
    options = {} if remat_pass else {"xla_disable_hlo_passes": "rematerialization"}
    program = api.build_program(GPU_MODEL, mesh, batch=(ROWS, SEQ, 0), execution=execution, target="gpu",
                                compiler_options=options)
    program, _ = api.optimize(program, topology=TOPOLOGY)
    t0 = time.perf_counter()
    result = api.analyze(program, TOPOLOGY)
    return {"mesh": mesh, "micro_batches": micro_batches, "matmuls": matmuls, "remat": remat, setting: once,
            "xla_remat_pass": remat_pass, "step_time_s": result["step_time_s"], "compute_s": result["compute_s"],
            "exposed_comm_s": result["exposed_comm_s"],
            "peak_memory_bytes": result["memory_per_device_bytes"]["peak_estimate"],
            "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="out/cast_once.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--setting", choices=SETTINGS, default=SETTINGS[0], help="the execution setting compared")
    args = ap.parse_args()
    setting = args.setting
    out: dict = {"setting": setting, "cpu": [cpu_row(setting, once, args.steps) for once in (False, True)]}
    name, overrides = CPU_MODEL
    print(f"{name} {overrides} on one CPU device, bf16, {CPU_BATCH[0]} x {CPU_BATCH[1]} in {CPU_MICRO_BATCHES} "
          f"micro-batches, median of {args.steps} steps:")
    for r in out["cpu"]:
        print(f"  {setting} {str(r[setting]):<6} step {r['median_step_s'] * 1e3:8.1f} ms   temp "
              f"{r['temp_bytes'] / 2**20:7.1f} MiB   first loss {r['loss']:.6f}  grad norm {r['grad_norm']:.6f}")
    per_read, once = out["cpu"]
    print(f"  ratio (off / on): {per_read['median_step_s'] / once['median_step_s']:.3f}x")
    from xlaopt.analysis import gpu_aot

    if not gpu_aot.available():
        print("the GPU-target part needs xlaopt[gpu-aot]; stopping here")
        write_json(out, args.json)
        return 0
    out["gpu"] = [gpu_row(mesh, mb, matmuls, remat, setting, once, remat_pass) for mesh, mb, matmuls, remat in GPU_LAYOUTS
                  for remat_pass in ((True, False) if remat == "none" else (True,)) for once in (False, True)]
    print(f"\n{GPU_MODEL} on {TOPOLOGY}, {ROWS} x {SEQ} a step (GPU target, priced at the fitted efficiencies):")
    print(f"  {'mesh':<18}{'micro':>6}{'matmuls':>9}{'remat':>20}{'XLA remat':>10}{'on':>6}{'step s':>9}"
          f"{'compute s':>11}{'peak GiB':>10}")
    for r in out["gpu"]:
        print(f"  {r['mesh']:<18}{r['micro_batches']:>6}{r['matmuls']:>9}{r['remat']:>20}"
              f"{'on' if r['xla_remat_pass'] else 'off':>10}"
              f"{str(r[setting]):>6}{r['step_time_s']:>9.2f}{r['compute_s']:>11.2f}"
              f"{r['peak_memory_bytes'] / 2**30:>10.1f}")
    write_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

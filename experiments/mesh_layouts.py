"""Mesh layouts side by side: the mesh-layout pass against no layout (everything replicated,
XLA's default when nothing is sharded), on several 8-device meshes, in one process run.

    python experiments/mesh_layouts.py [--steps 8] [--json out/mesh_layouts.json]

Expected on a 2-core machine: ~10 minutes (two compiles of ~25 s per mesh, and replicated steps
of ~9 s each since every device then computes the whole batch).
Expected result: with the pass, parameter+optimizer bytes per device fall by the fsdp x tensor
factor and the compiled HLO holds all-gathers / reduce-scatters; replicated runs hold one
gradient all-reduce set and no gathers. CPU wall-clock ratios say little about a GPU cluster
(8 simulated devices share 2 cores): read memory and collectives first, time last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

MESHES = ("data=8", "fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective instructions in scheduled HLO (an async pair counts once, by its -start)."""
    counts = {}
    for kind in COLLECTIVES:
        pattern = rf"= [^=]*? {kind}(-start)?\("
        counts[kind] = len(re.findall(pattern, hlo_text))
    return counts


def measure(program, steps: int) -> dict:
    import jax

    import xlaopt
    from xlaopt.families import family_of

    compiled = xlaopt.compile_program(program)
    t0 = time.perf_counter()
    step = compiled.train_step
    compile_s = time.perf_counter() - t0
    memory = step.memory_analysis()
    key = jax.random.key(0)
    state = compiled.init(key)
    data = family_of(program.model).synthetic(program.model, program.settings.batch, 0)
    times = []
    for i in range(steps):
        batch = compiled.put_batch(data.batch(i))
        t = time.perf_counter()
        state, metrics = step(state, batch, key)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    return {
        "compile_s": compile_s,
        "median_step_s": statistics.median(times[1:] or times),
        "argument_bytes_per_device": memory.argument_size_in_bytes,
        "temp_bytes_per_device": memory.temp_size_in_bytes,
        "collectives": collective_counts(step.as_text()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cosmos3-tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--meshes", default=";".join(MESHES))
    parser.add_argument("--json", default="out/mesh_layouts.json")
    args = parser.parse_args()

    import xlaopt
    from xlaopt.mesh import MeshSpec

    meshes = [MeshSpec.parse(m) for m in args.meshes.split(";")]
    xlaopt.simulated_devices(max(m.num_devices for m in meshes))

    rows = []
    for mesh in meshes:
        base = xlaopt.build_program(args.model, mesh)
        laid_out, _ = xlaopt.optimize(base)
        for variant, program in (("replicated", base), ("mesh-layout", laid_out)):
            row = {"mesh": str(mesh), "variant": variant, **measure(program, args.steps)}
            rows.append(row)
            c = row["collectives"]
            print(f"{row['mesh']:<24}{variant:<13}args/dev {row['argument_bytes_per_device'] / 2**20:7.1f} MiB  "
                  f"temp/dev {row['temp_bytes_per_device'] / 2**20:7.1f} MiB  "
                  f"AG {c['all-gather']:3d} RS {c['reduce-scatter']:3d} AR {c['all-reduce']:3d}  "
                  f"step {row['median_step_s']:.3f}s", flush=True)
    by = {(r["mesh"], r["variant"]): r for r in rows}
    print("\nratio replicated / mesh-layout (argument bytes per device; median step time):")
    for mesh in meshes:
        a, b = by[(str(mesh), "replicated")], by[(str(mesh), "mesh-layout")]
        print(f"  {str(mesh):<24}{a['argument_bytes_per_device'] / b['argument_bytes_per_device']:6.2f}x memory  "
              f"{a['median_step_s'] / b['median_step_s']:6.2f}x time")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "steps": args.steps, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

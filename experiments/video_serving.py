"""Cosmos 3 text-to-video requests priced by xlaopt against NVIDIA's published times (issue 30).

    python experiments/video_serving.py [--json out/video_serving.json]

Every row of experiments/published_video_times.csv (NVIDIA/cosmos docs/reference/benchmarks.md,
the PyTorch engine: BF16, batch 1, NVIDIA's profile of 35 steps at guidance 6) priced by
`xlaopt.planning.serving_video` as that reference runs: the joint sequence every step (no prompt
K/V reuse when the times were published), both guidance branches, then the VAE decode on one
GPU. Each row on 4 and 8 GPUs is priced on two layouts, because the sources disagree:
  tensor     the benchmark page's own note, "4x/8x GPU configurations use tensor parallelism";
  cfg x sp   the reference code's `latency` preset (cosmos-framework `inference/args.py`: tp_size
             fixed at 1, cfg = 2, Ulysses context parallel over the rest).
Nothing is fitted to these rows: the matmul fraction is the training fit's, the forward attention
fraction a published kernel's (`costmodel.FORWARD_ATTENTION`). The prompt lengths are estimates
(`VideoProfile`), which matter most at 256p, where the text is a large part of each row.

Then the planner's layouts for Nano and Super on 8 H200 (xlaopt's sampler, prompt K/V cached),
beside tensor 8. Prints tables, writes JSON. Analytic: seconds on 2 cores.
"""
from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def published() -> list[dict]:
    with open(HERE / "published_video_times.csv", newline="") as f:
        return [dict(r, gpus=int(r["gpus"]), seconds=float(r["seconds"])) for r in csv.DictReader(f)]


def priced_rows() -> list[dict]:
    from xlaopt.analysis import costmodel as cm
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.inference.video_profile import VideoProfile
    from xlaopt.models.registry import get_config
    from xlaopt.planning import serving_video as sv

    out = []
    for row in published():
        config, n = get_config(row["model"]), row["gpus"]
        topology = parse_topology(f"{row['gpu']}:1x{n}")
        eff, profile = cm.serving_efficiency(topology), VideoProfile(resolution=row["resolution"])
        layouts = {"tensor": sv.VideoLayout(1, 1, 1, n), "cfg x sp": sv.reference_layout(n)}
        priced = {}
        for name, layout in layouts.items():
            p = sv.price_video(config, profile, layout, topology, eff, cached=False)
            priced[name] = {"layout": layout.name, "seconds": p.seconds, "error": p.seconds / row["seconds"] - 1,
                            "parts": p.parts, "memory_gib": p.memory_bytes / 2**30}
        out.append({**row, "priced": priced})
    return out


def planner_rows() -> list[dict]:
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.inference.video_profile import VideoProfile
    from xlaopt.models.registry import get_config
    from xlaopt.planning import serving_video as sv

    out = []
    for model in ("cosmos3-nano", "cosmos3-super"):
        ranked = sv.plan_video(get_config(model), parse_topology("h200:1x8"), VideoProfile())
        best = ranked[0]
        tp8 = next(p for p in ranked if p.layout == sv.VideoLayout(1, 1, 1, 8))
        out.append({"model": model, "best": best.layout.name, "best_s": best.seconds, "best_parts": best.parts,
                    "best_gib": best.memory_bytes / 2**30, "tp8_s": tp8.seconds, "tp8_parts": tp8.parts,
                    "tp8_gib": tp8.memory_bytes / 2**30,
                    "ranked": [(p.layout.name, p.seconds, p.reason) for p in ranked[:6]]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = priced_rows()
    print(f"{'model':<14}{'gpu':<6}{'res':<6}{'n':>3}{'published':>11}{'tensor':>9}{'err':>8}{'cfg x sp':>10}"
          f"{'err':>8}   vae s")
    for r in rows:
        t, c = r["priced"]["tensor"], r["priced"]["cfg x sp"]
        print(f"{r['model']:<14}{r['gpu']:<6}{r['resolution']:<6}{r['gpus']:>3}{r['seconds']:>11.2f}"
              f"{t['seconds']:>9.1f}{t['error']:>+8.1%}{c['seconds']:>10.1f}{c['error']:>+8.1%}   "
              f"{t['parts']['vae']:.1f}")
    plans = planner_rows()
    print("\nplanned on 8 H200, xlaopt's sampler (prompt K/V cached):")
    for p in plans:
        print(f"  {p['model']:<14} best {p['best']:<18} {p['best_s']:7.1f} s ({p['best_gib']:.0f} GiB/dev)   tensor 8 "
              f"{p['tp8_s']:7.1f} s ({p['tp8_gib']:.0f} GiB/dev, all-reduces {p['tp8_parts']['tp']:.1f} s)")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "planned": plans}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Goodput at a thousand GPUs: cosmos3-nano's planned layout on 128 x 8 H100 run for 72 hours,
failure by failure, with one checkpoint tier and with two (a local tier copied to a peer node).

    python experiments/goodput_at_scale.py [--hours 72] [--seeds 500] [--json out/goodput_at_scale.json]

Each cost the simulation uses, and where it comes from:
  step          the planner's analytic price of its best layout for 720p rows, one a GPU (priced);
  save          what an xlaopt save blocks the loop for: on-device copies of each GPU's shard of the
                state, at the H100's HBM bandwidth (priced);
  write         the persistent save's write behind the loop, which the next save waits for: one
                replica's state from the nodes that hold it, at this VM's measured save rate, 771 MB/s
                a node (BENCHMARKS.md, checkpoints); the local tier's copy to a peer is not priced;
  restore       each node's shards read back from the persistent tier at this VM's measured cold
                restore rate, 1,327 MB/s a node (BENCHMARKS.md, checkpoints; a stand-in for a node's
                share of a cluster file system), and from the local tier, host memory, over PCIe at
                an assumed 25 GB/s a GPU;
  start-up      a restarted process's start, `jax.distributed` over 128 nodes and the step's
                executable loaded from the persistent compile cache: an assumed 60 s (measured here
                for the quick-start job on one host: 4.9 s);
  gap           the failure noticed (xlaopt's watchdog: the peer timeout, an assumed 30 s) and the
                job launched again by the cluster's scheduler (an assumed 60 s): 90 s.
Failures: Llama 3's published rate (419 unexpected interruptions in 54 days on 16,384 H100), and
ten times it; at ten times it also with restarts of 30 minutes (start-up 25, gap 5; assumed). The checkpoint's state is the model's fp32 parameters and AdamW's two moments.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

RESTORE_NODE_BYTES_PER_S = 1327e6  # BENCHMARKS.md: `xlaopt bench checkpoint`, cold restore, 2026-12-02
WRITE_NODE_BYTES_PER_S = 771e6  # the same run's save rate
LOCAL_RESTORE_GPU_BYTES_PER_S = 25e9  # assumed: host memory to an H100 over PCIe Gen5 x16
STARTUP_S, PEER_TIMEOUT_S, RELAUNCH_S = 60.0, 30.0, 60.0  # assumed (see the docstring)


def planned_layout(model: str, topology_spec: str, mix: str) -> dict:
    import jax
    import numpy as np
    from layout_planner import base_program

    from xlaopt.analysis.topology import parse_topology
    from xlaopt.planning.planner import plan
    from xlaopt.step import abstract_state

    topology = parse_topology(topology_spec)
    program, batch = base_program(model, topology, mix, None, None)
    best = plan(program, topology, batch, top=0, stages=(1,), precisions=("bfloat16",)).best
    state = abstract_state(program)
    leaves = jax.tree.leaves((state.params, state.opt_state))
    state_bytes = float(sum(np.prod(a.shape) * a.dtype.itemsize for a in leaves))
    c = best.candidate
    shards = c.fsdp * c.tp * c.cp * c.pp  # the state is split over these; data-parallel replicas hold copies
    return {"model": model, "topology": topology_spec, "rows": mix, "layout": str(c),
            "step_s": best.analytic.step_time_s, "state_bytes": state_bytes, "shard_bytes": state_bytes / shards,
            "devices_per_node": topology.devices_per_node, "hbm_bytes_per_s": topology.device.hbm_bytes_per_s,
            "gpus": topology.num_devices}


def job_costs(layout: dict, two_tiers: bool, startup_s: float = STARTUP_S, gap_s: float = PEER_TIMEOUT_S + RELAUNCH_S):
    from xlaopt.goodput.costs import JobCosts

    shard, per_node = layout["shard_bytes"], layout["devices_per_node"]
    save_s = 2 * shard / layout["hbm_bytes_per_s"]  # an on-device copy reads and writes the shard
    local = dict(local_save_s=save_s, local_restore_s=shard / LOCAL_RESTORE_GPU_BYTES_PER_S) if two_tiers else {}
    sources = (("step_s", "priced: the planner's analytic step"), ("save_s", "priced: on-device copy at HBM bandwidth"),
               ("restore_s", "measured: this VM's cold restore rate a node"), ("startup_s", "assumed"),
               ("gap_s", "assumed: watchdog and relaunch"))
    if two_tiers:
        sources += (("local_save_s", "priced: on-device copy at HBM bandwidth"),
                    ("local_restore_s", "assumed: 25 GB/s host to GPU"))
    writers = max(1, round(layout["state_bytes"] / shard / per_node))  # the nodes holding one replica
    write_s = layout["state_bytes"] / writers / WRITE_NODE_BYTES_PER_S
    sources += (("write_s", f"measured: this VM's save rate a node, {writers} nodes writing"),)
    return JobCosts(step_s=layout["step_s"], save_s=save_s, restore_s=shard * per_node / RESTORE_NODE_BYTES_PER_S,
                    startup_s=startup_s, gap_s=gap_s, write_s=write_s, sources=sources, **local)


def main() -> int:
    from xlaopt.goodput.failures import HOUR_S, LLAMA3
    from xlaopt.goodput.report import format_plan, plan_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=72.0)
    ap.add_argument("--seeds", type=int, default=500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layout = planned_layout("cosmos3-nano", "h100:128x8", "cosmos3-720p")
    print(f"{layout['model']} on {layout['topology']}, {layout['rows']} rows: planned {layout['layout']}, step "
          f"{layout['step_s']:.2f} s (priced); state {layout['state_bytes'] / 2**30:.1f} GiB, "
          f"{layout['shard_bytes'] / 2**20:.1f} MiB a GPU")
    rows = []
    # The third: restarts as slow as a large cluster's often are (a 25-minute start-up, a 5-minute gap).
    tenfold = f"{LLAMA3.mtbf_gpu_h / 10:.6g}"
    scenarios = (("Llama 3's rate", "llama3", {}), ("10x Llama 3's rate", tenfold, {}),
                 ("10x, 30-min restarts", tenfold, {"startup_s": 1500.0, "gap_s": 300.0}))
    for rate, mtbf, slow in scenarios:
        for tiers in (1, 2):
            report = plan_report(job_costs(layout, tiers == 2, **slow), mtbf, layout["gpus"],
                                 layout["devices_per_node"], True, args.hours, args.seeds)
            print(f"\n== {rate}, {tiers} tier{'s' * (tiers > 1)}\n" + format_plan(report))
            planned = report["intervals"][0]
            sim = planned["simulated"]
            rows.append({"failures": rate, "tiers": tiers, "every": planned["every"], "local_every": planned["local_every"],
                         "goodput": sim["goodput"], "goodput_p5": sim["goodput_p5"], "goodput_p95": sim["goodput_p95"],
                         "restarts": sim["restarts"],
                         "lost_hours": sim["badput"]["lost_progress_s"] / HOUR_S,
                         "badput_hours": {k: v / HOUR_S for k, v in sim["badput"].items()}, "report": report})
    print(f"\n{'failures':<20}{'tiers':>6}{'goodput':>9}  [p5, p95]       {'restarts':>9}{'lost h':>8}  badput hours "
          f"(start-up, save, restore, lost, gaps)")
    for r in rows:
        b = r["badput_hours"]
        print(f"{r['failures']:<20}{r['tiers']:>6}{100 * r['goodput']:>8.1f}%  [{100 * r['goodput_p5']:.1f}, "
              f"{100 * r['goodput_p95']:.1f}]   {r['restarts']:>9.2f}{r['lost_hours']:>8.2f}  "
              + ", ".join(f"{b[k]:.2f}" for k in ("startup_compile_s", "checkpoint_save_s", "checkpoint_restore_s",
                                                  "lost_progress_s", "restart_gaps_s")))
    print("\nclaimed: above 92% over 72 hours on about 1,000 GPUs; Llama 3 405B: above 90% effective training time")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps({"layout": layout, "hours": args.hours, "seeds": args.seeds,
                                                       "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fault injection: a long multi-process training run killed (SIGKILL) at random times and
restarted each time, against one uninterrupted run of the same job.

    python experiments/fault_injection.py [--steps 3000] [--kills 12] [--seed 0] [--every 100]
        [--local-every 10] [--replan 0] [--relaunch] [--json OUT]

The job: a tiny decoder (llama-tiny cut down) on 2 processes x 2 simulated CPU devices (mesh
data=4), float32, an asynchronous persistent checkpoint every `--every` steps and, unless
`--local-every 0`, a local tier (`--local-ckpt` on /dev/shm, each process's shards copied to the
other) every `--local-every` steps. The harness watches process 0's goodput ledger, kills a
random process after a random number of steps. The launcher restarts the job itself
(`train --restarts`: its processes forked afresh from its zygote, with `--resume`); with
`--relaunch`, or a `--replan` share of restarts, this harness starts a new launcher with
`--resume` instead: on the original layout, or on 1 process of 2 devices with `xlaopt plan
--topology cpu:1x2`'s layout, which the local tier cannot serve. Prints each attempt, the job's
goodput and badput from the final attempt's train JSON, and the comparison with the uninterrupted
run: `ckpt diff` of the final states (bit-identical when no restart changed the layout; another
layout orders its sums otherwise), the losses of the last steps, and the samples seen; and the
simulator's prediction of the job's goodput from the costs its ledger measured and this
harness's kill rule (`predicted_goodput`).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from xlaopt.runtime import goodput

MODEL = ["--model", "llama-tiny", "--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128",
         "--set", "vocab_size=256", "--dtype", "float32", "--batch-size", "4", "--text-len", "32", "--no-progress"]
MESH = ["--mesh", "data=4"]
# The replanned layout's losses differ from the original's only by the order of float32 sums,
# compounded over the steps trained on it.
LOSS_RTOL = 1e-3


def _xlaopt(*args, **kw) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", "xlaopt.cli", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)


class _Progress:
    """The furthest step process 0's ledger shows, read incrementally: parsing the whole ledger
    every poll took CPU from the job it watches (thousands of lines, fifty times a second, on a
    2-core host)."""

    def __init__(self, ledger: pathlib.Path):
        self.ledger, self.offset, self.done, self.partial = ledger, 0, -1, b""

    def __call__(self) -> int:
        if not self.ledger.exists():
            return self.done
        with open(self.ledger, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()  # a line not yet ended
        for line in lines:
            if line.startswith(b'{"step"') and line.endswith(b"}"):
                self.done = max(self.done, json.loads(line)["step"])
        return self.done


def _resume_points(ledger: pathlib.Path) -> list[int]:
    """The step each attempt in the ledger resumed from, in order."""
    events = [json.loads(line) for line in ledger.read_text().splitlines() if line.endswith("}")]
    return [next((e["resumed_from"] for e in run if "resumed_from" in e), None) for run in goodput.attempts(events)]


def _children(launcher: subprocess.Popen) -> list[int]:
    """The launcher's train processes, in process-id order."""
    from xlaopt.runtime.zygote import job_processes

    procs = job_processes(launcher.pid)
    return [procs[i] for i in sorted(procs)]


def predict(ledger: pathlib.Path, measured: dict, steps: int, every: int, kills: int, local_every: int = 0,
            replan: float = 0.0, late: int = 0, seeds: int = 200) -> dict:
    """The simulator's goodput for this run (`xlaopt.goodput.simulate`): the costs this job's own
    ledger measured (means over its attempts of a step, a save, a restore, a restart's start-up
    and gap; a step's host work outside its timed part from the ledger's `other`), and this
    harness's kill rule (landing `late` steps past each target, as its kills did), the kills drawn
    afresh for each of `seeds` runs."""
    import dataclasses
    import math
    import statistics

    from xlaopt.goodput.costs import job_costs
    from xlaopt.goodput.interval import Intervals
    from xlaopt.goodput.simulate import Harness, simulate_many

    events = goodput.read(str(ledger.parent))
    executed = sum(1 for e in events if "step" in e)
    local = local_every > 0 and any("local_restore_s" in e for e in events)
    # A restart the local tier serves reads no persistent step: its time is then the local one's.
    restore = None if local is False or any("restore_s" in e for e in events) else \
        statistics.fmean(e["local_restore_s"] for e in events if "local_restore_s" in e)
    costs = job_costs(events, step_overhead_s=measured["badput"]["other_s"] / executed, restore_s=restore)
    # A SIGKILL takes a process, not its node: the local tier always survives here (local_loss 0),
    # unless restarts move to another layout, which the local tier cannot serve.
    intervals = Intervals(every, local_every if local else None)
    sim = simulate_many(costs, intervals, math.inf, math.inf, seeds, local_loss=replan if local else 1.0,
                        harness=Harness(steps, kills, late=late))
    return {"predicted_goodput": sim["goodput"], "p5": sim["goodput_p5"], "p95": sim["goodput_p95"], "seeds": seeds,
            "kills_late_steps": late,
            "costs": {k: v for k, v in dataclasses.asdict(costs).items() if k != "sources"},
            "badput": sim["badput"]}


def planned_local_every(events: list[dict], measured: dict, kills: int, devices: int = 4) -> dict:
    """The local interval `plan_intervals` (Daly's) gives this job: its ledger's costs, and a failure
    every wall / kills seconds, the rate this harness's kills came at (they are not Poisson: Daly
    models them as if they were)."""
    from xlaopt.goodput.costs import job_costs
    from xlaopt.goodput.failures import FailureModel
    from xlaopt.goodput.interval import plan_intervals

    executed = sum(1 for e in events if "step" in e)
    costs = job_costs(events, step_overhead_s=measured["badput"]["other_s"] / executed,
                      restore_s=measured["badput"]["checkpoint_restore_s"] / max(1, measured["restarts"]))
    job_mtbf_s = measured["wall_s"] / kills
    failures = FailureModel(job_mtbf_s * devices / 3600, f"a kill every {job_mtbf_s:.1f} s, this run's rate")
    intervals, _ = plan_intervals(costs, failures, devices, devices // 2, peer_copy=True)
    return {"local_every": intervals.local_every, "job_mtbf_s": job_mtbf_s, "local_save_s": costs.local_save_s,
            "step_s": costs.step_s}


def _faulted_job(args, common: list, tier: list, work: pathlib.Path) -> tuple[list[dict], int, float]:
    """Run the job, killing it `args.kills` times; (attempts, kills, seconds). On one layout the
    launcher restarts the job itself (`--restarts`, its processes forked afresh from its zygote);
    with `--replan` (or `--relaunch`) this harness starts a new launcher for each attempt."""
    rng = random.Random(args.seed)
    replanned = work / "two_devices.json"
    if args.replan:
        plan = _xlaopt("plan", *MODEL[:10], "--topology", "cpu:1x2", "--global-batch", 4, "--seq", 32, "--top", 0,
                       "--out", replanned)
        assert plan.wait() == 0, plan.stderr.read()[-3000:]
    in_place = not (args.replan or args.relaunch)
    job = work / "job"
    steps_done = _Progress(job / "goodput.jsonl")
    attempts, kills, t_job = [], 0, time.time()
    while True:
        fewer = kills > 0 and rng.random() < args.replan
        layout = ["--layout", replanned] if fewer else MESH
        # One process alone has no peer: its local tier keeps its own copy only.
        local = [*tier, "--local-peers", 0] if tier and fewer else tier
        restarts = ["--restarts", args.kills] if in_place else []
        launcher = _xlaopt("train", *common, *layout, *local, "--processes", 1 if fewer else 2, *restarts,
                           "--ckpt", job, "--resume", "--json", work / "job.json")
        record = {"processes": 1 if fewer else 2, "layout": "replanned cpu:1x2" if fewer else "data=4"}
        while kills < args.kills:
            target = steps_done() + rng.randint(20, 400)
            while steps_done() < target and launcher.poll() is None:
                time.sleep(0.02)
            if launcher.poll() is not None:
                break
            victims = _children(launcher) if not fewer else []
            victim = rng.randrange(len(victims)) if victims else None
            os.kill(victims[victim] if victims else launcher.pid, signal.SIGKILL)
            kills += 1
            attempts.append(dict(record, killed="process %s" % (victim if victim is not None else 0),
                                 target=target, at_step=steps_done()))
            if not in_place:
                break
        code = launcher.wait()
        if code and not in_place and attempts and "exit" not in attempts[-1]:
            attempts[-1]["exit"] = code  # the attempt this harness killed
        if code == 0:
            attempts.append(dict(record, exit=0))
            break
    for record, resumed in zip(attempts, _resume_points(job / "goodput.jsonl")):
        record["resumed_from"] = resumed
    for n, record in enumerate(attempts, 1):
        print(f"attempt {n:2d}: {record['processes']} process(es), {record['layout']:18s} resumed from step "
              f"{record['resumed_from']:5d}" + (f", killed {record['killed']} after step {record['at_step']}"
                                              if "killed" in record else "")
              + (f", exit {record['exit']}" if "exit" in record else ", restarted by its launcher"), flush=True)
    return attempts, kills, time.time() - t_job


def _against_reference(args, work: pathlib.Path, attempts: list[dict]) -> dict:
    """The faulted job's final state and last losses against the uninterrupted run's."""
    ref, final = (json.loads((work / f"{n}.json").read_text()) for n in ("ref", "job"))
    diff = subprocess.run([sys.executable, "-m", "xlaopt.cli", "ckpt", "diff", work / "ref", work / "job", "--step",
                           str(args.steps)], capture_output=True, text=True)
    same_layout = all(a["layout"] == "data=4" for a in attempts)
    tail = ref["steps"][-len(final["steps"]):]
    max_rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(final["steps"], tail))
    tokens_equal = [r["tokens"] for r in final["steps"]] == [r["tokens"] for r in tail]
    print(f"uninterrupted run: goodput {100 * ref['goodput']['goodput']:.1f}% of {ref['goodput']['wall_s']:.0f} s")
    print(f"final state vs uninterrupted: ckpt diff exit {diff.returncode} "
          f"({'bit-identical' if diff.returncode == 0 else 'differs'}; expected "
          f"{'identical' if same_layout else 'to differ: a restart ran on another layout'})")
    print(f"last loss {final['steps'][-1]['loss']:.6f} vs {ref['steps'][-1]['loss']:.6f}; the final attempt's "
          f"{len(final['steps'])} losses within {max_rel:.1e} relative (tolerance {LOSS_RTOL:g}); their tokens "
          f"equal: {tokens_equal}")
    return {"reference_goodput": ref["goodput"], "ckpt_diff_exit": diff.returncode,
            "same_layout_throughout": same_layout, "last_loss": final["steps"][-1]["loss"],
            "reference_last_loss": ref["steps"][-1]["loss"], "max_rel_loss_diff_final_attempt": max_rel,
            "tokens_equal": tokens_equal,
            "ok": max_rel <= LOSS_RTOL and tokens_equal and (diff.returncode == 0 or not same_layout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=100, help="checkpoint every K steps")
    ap.add_argument("--local-every", type=int, default=10, help="local-tier save every K steps (0: no local tier)")
    ap.add_argument("--replan", type=float, default=0.0,
                    help="the share of restarts onto 1 process with a replanned layout (default 0: one layout)")
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--relaunch", action="store_true",
                    help="start a new launcher for each attempt (a fresh Python and its imports) instead of "
                         "`train --restarts`, which restarts the job's processes from its zygote")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the uninterrupted run (for sweeps of the interval: goodput only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="xlaopt-faults-"))
    # Node-local memory where there is some, as a job on a real node would use.
    shm = pathlib.Path("/dev/shm")
    node_local = pathlib.Path(tempfile.mkdtemp(prefix="xlaopt-faults-local-", dir=shm if shm.is_dir() else None))
    common = [*MODEL, "--steps", args.steps, "--ckpt-every", args.every, "--peer-timeout", 10]
    local_every = ["--local-every", args.local_every]
    t0 = time.time()
    if not args.no_reference:
        tier = ["--local-ckpt", node_local / "ref", *local_every] if args.local_every else []
        reference = _xlaopt("train", *common, *MESH, *tier, "--processes", 2, "--ckpt", work / "ref",
                            "--json", work / "ref.json")
        assert reference.wait() == 0, reference.stderr.read()[-3000:]
    reference_s = time.time() - t0
    tier = ["--local-ckpt", node_local / "job", *local_every] if args.local_every else []
    attempts, kills, job_s = _faulted_job(args, common, tier, work)
    shutil.rmtree(node_local, ignore_errors=True)

    g = json.loads((work / "job.json").read_text())["goodput"]
    events = goodput.read(str(work / "job"))
    # How many steps past its target a kill landed, on average: the harness's own reaction time.
    late = [a["at_step"] - a["target"] for a in attempts if "target" in a]
    prediction = predict(work / "job" / "goodput.jsonl", g, args.steps, args.every, kills, args.local_every,
                         args.replan, round(statistics.fmean(late)) if late else 0)
    planned = planned_local_every(events, g, kills) if args.local_every else None
    restores = [e for e in events if "restore_s" in e or "local_restore_s" in e]
    print(f"\n{kills} SIGKILLs, {g['restarts']} restarts ({sum(a['processes'] == 1 for a in attempts)} on 1 process "
          f"with the replanned layout), {g['lost_steps']} steps lost and redone")
    print(f"restores: {sum('local_restore_s' in e for e in restores)} from the local tier, "
          f"{sum('restore_s' in e for e in restores)} from the persistent one; each restart's time to its first step "
          f"(median) {statistics.median(r['to_first_step_s'] for r in g['restart_times']):.2f} s, cold start "
          f"{g['cold_start_s']:.2f} s")
    print(f"goodput {100 * g['goodput']:.1f}% of {g['wall_s']:.0f} s wall")
    print("badput: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in g["badput"].items()))
    compared = {} if args.no_reference else _against_reference(args, work, attempts)
    print(f"predicted goodput {100 * prediction['predicted_goodput']:.1f}% (the simulator over "
          f"{prediction['seeds']} draws of the kills, 5th-95th percentile {100 * prediction['p5']:.1f}-"
          f"{100 * prediction['p95']:.1f}%), measured {100 * g['goodput']:.1f}%: "
          f"{100 * (prediction['predicted_goodput'] - g['goodput']):+.1f} points")
    if planned:
        print(f"the local interval Daly's plan gives this job: every {planned['local_every']} steps (a kill every "
              f"{planned['job_mtbf_s']:.1f} s, a local save {1e3 * planned['local_save_s']:.1f} ms, a step "
              f"{1e3 * planned['step_s']:.1f} ms); this run saved every {args.local_every}")
    print(f"harness wall time {time.time() - t0:.0f} s (uninterrupted run {reference_s:.0f} s, faulted job {job_s:.0f} s)")
    ok = kills >= min(args.kills, 10) and compared.get("ok", True)
    result = {"steps": args.steps, "every": args.every, "local_every": args.local_every, "replan": args.replan,
              "kills": kills, "attempts": attempts, "goodput": g,
              "restores": {"local": sum("local_restore_s" in e for e in restores),
                           "persistent": sum("restore_s" in e for e in restores)},
              "predicted_goodput": prediction["predicted_goodput"], "prediction": prediction,
              "planned_local_every": planned, "reference_s": reference_s, "job_s": job_s, **compared, "ok": ok}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

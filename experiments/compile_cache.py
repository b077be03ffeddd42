"""The quick-start command run twice on one compile cache: the second start loads the step's
executables from JAX's persistent cache instead of compiling them.

    python experiments/compile_cache.py [--repeats 3] [--steps 2] [--json out/compile_cache.json]

Each repeat runs, in fresh processes, the README's quick-start training (`cosmos3-tiny` on
`data=2,fsdp=2,tensor=2`) three times:
  warm-up  with `--compile-cache off`: makes the sample store the command makes on first use,
           and warms the OS's file cache, so neither lands on the runs compared;
  first    on an empty cache directory: compiles and writes the cache;
  second   on the same directory: what a second start sees;
  restart  a job with a checkpoint every step, SIGKILLed once step 2 is committed and launched
           again with `--resume` at once (issue 31): from the kill to the resumed run's first
           step, beside what the job's goodput ledger says of that restart (gap, start-up, restore).
Time to first step is from starting the process to its progress line for step 1 (stderr). The
compiled HLO of both runs (`--dump-hlo`) is compared without its source-location tables, whose
order follows Python's hash seed (`xlaopt.analysis.hlo.without_source_locations`). Medians over
the repeats, and the ratio second / first.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

QUICK_START = ["train", "--model", "cosmos3-tiny", "--mesh", "data=2,fsdp=2,tensor=2"]


def _xlaopt() -> str:
    return str(pathlib.Path(sys.executable).with_name("xlaopt"))


def time_to_first_step(args: list[str], env: dict, since: float | None = None) -> float:
    """Seconds from starting `xlaopt args` (or from `since`, a perf_counter reading) to its progress
    line for step 1; the run must pass."""
    start = time.perf_counter() if since is None else since
    proc = subprocess.Popen([_xlaopt(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    first, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if first is None and "] 1/" in line:
            first = time.perf_counter() - start
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"xlaopt {' '.join(args)} failed ({proc.returncode}):\n{''.join(lines)[-3000:]}")
    return first


def kill_to_first_step(command: list[str], env: dict, ckpt: pathlib.Path) -> dict:
    """A job killed once step 2 is committed and relaunched with --resume at once: seconds from
    the kill to the relaunched run's first step, and the ledger's own account of that restart."""
    from xlaopt.checkpoint.layout import committed_steps
    from xlaopt.runtime import goodput

    base = [*command, "--ckpt", str(ckpt), "--ckpt-every", "1"]
    job = subprocess.Popen([_xlaopt(), *base, "--steps", "1000"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=env)
    while not (ckpt.is_dir() and max(committed_steps(ckpt), default=0) >= 2):
        if job.poll() is not None:
            raise SystemExit(f"the job to kill exited {job.returncode} before its second checkpoint")
        time.sleep(0.02)
    job.kill()
    killed = time.perf_counter()
    job.wait()
    resume_at = max(committed_steps(ckpt))
    first_step_s = time_to_first_step(base + ["--resume", "--steps", str(resume_at + 2)], env, since=killed)
    ledger = goodput.goodput(goodput.read(str(ckpt)), time.time())
    return {"kill_to_first_step_s": first_step_s, "ledger": ledger["restart_times"][-1]}


def compiled_step(dump: pathlib.Path) -> str:
    from xlaopt.analysis.hlo import without_source_locations

    texts = sorted(dump.glob("*.compiled.hlo"))
    return without_source_locations(texts[-1].read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="xlaopt-compile-cache-") as tmp:
        env = {**os.environ, "XLAOPT_CACHE": str(pathlib.Path(tmp) / "home")}  # the store, made once
        command = QUICK_START + ["--steps", str(a.steps)]
        for r in range(a.repeats):
            time_to_first_step(command + ["--compile-cache", "off"], env)
            cache, runs = pathlib.Path(tmp) / f"cache-{r}", {}
            for label in ("first", "second"):
                dump = pathlib.Path(tmp) / f"dump-{r}-{label}"
                runs[label] = time_to_first_step(command + ["--compile-cache", str(cache), "--dump-hlo", str(dump)],
                                                 env)
                runs[f"{label}_hlo"] = compiled_step(dump)
            restart = kill_to_first_step(command[:-2] + ["--compile-cache", str(cache)], env,
                                         pathlib.Path(tmp) / f"ckpt-{r}")
            rows.append({"first_s": runs["first"], "second_s": runs["second"],
                         "ratio": runs["second"] / runs["first"],
                         "restart_s": restart["kill_to_first_step_s"],
                         "restart_ratio": restart["kill_to_first_step_s"] / runs["first"],
                         "restart_ledger": restart["ledger"],
                         "hlo_identical": runs["first_hlo"] == runs["second_hlo"],
                         "cache_bytes": sum(p.stat().st_size for p in cache.iterdir())})
            print(f"repeat {r}: first {runs['first']:.1f} s, second {runs['second']:.1f} s "
                  f"({rows[-1]['ratio']:.2f}x), compiled HLO identical: {rows[-1]['hlo_identical']}; killed and "
                  f"resumed: {restart['kill_to_first_step_s']:.1f} s from the kill to the first step "
                  f"({rows[-1]['restart_ratio']:.2f}x the first start; the ledger: gap "
                  f"{restart['ledger']['gap_s']:.1f} s, start-up {restart['ledger']['setup_s']:.1f} s, restore "
                  f"{restart['ledger']['restore_s']:.2f} s)", flush=True)
    summary = {"command": "xlaopt " + " ".join(command), "repeats": rows,
               "first_median_s": statistics.median(r["first_s"] for r in rows),
               "second_median_s": statistics.median(r["second_s"] for r in rows),
               "ratio_median": statistics.median(r["ratio"] for r in rows),
               "hlo_identical": all(r["hlo_identical"] for r in rows),
               "restart_median_s": statistics.median(r["restart_s"] for r in rows),
               "restart_ratio_median": statistics.median(r["restart_ratio"] for r in rows)}
    print(f"time to first step, median of {a.repeats}: first {summary['first_median_s']:.1f} s, second "
          f"{summary['second_median_s']:.1f} s: {summary['ratio_median']:.2f}x; HLO identical: {summary['hlo_identical']}; "
          f"killed and resumed, kill to first step {summary['restart_median_s']:.1f} s: "
          f"{summary['restart_ratio_median']:.2f}x the first start")
    if a.json:
        pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

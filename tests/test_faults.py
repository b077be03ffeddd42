"""Faults in a real two-process `jax.distributed` job (gloo), and restarts that lose nothing.

One job is killed (SIGKILL), stopped (SIGSTOP) and asked to stop (SIGTERM) in turn, resuming
each time; its final state must be bit-identical to an uninterrupted run's (`ckpt diff` exit
0). A second job loses a process and continues on what remains with a layout the planner made
for the remaining devices: it must consume exactly the uninterrupted run's samples.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from xlaopt.checkpoint.layout import read_manifest, step_dir_name
from xlaopt.checkpoint.restore import read_all
from xlaopt.cli import main
from xlaopt.data.synthetic_store import make_store
from xlaopt.models.registry import get_config
from xlaopt.runtime.faults import EXIT_PEER_LOST
from xlaopt.runtime.zygote import job_processes

from conftest import command_env, finish, free_port

TINY = ["--model", "llama-tiny", "--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128",
        "--set", "vocab_size=256", "--mesh", "data=2", "--dtype", "float32", "--batch-size", "4", "--text-len", "32",
        "--no-progress"]
STEPS, EVERY = 120, 10  # room for the SIGTERM agreement (some 30 steps here) before the end
PEER_TIMEOUT_S = 5
# A survivor stops within the peer timeout of its last finished step; allow for that step
# (tens of ms here), the watchdog's half-second poll and a loaded 2-core machine.
BOUND_S = PEER_TIMEOUT_S + 5
TIMEOUT_S = 300


def _xlaopt(*args, fast_compile: bool = False):
    # Each process brings the devices its share of the mesh needs. Compiled as a user's unless asked:
    # with the suite's -O0 the killed-and-resumed job once ended bit-different from the reference (a
    # clean clone's CI, 2026-12-03), not yet understood; jobs compared within a tolerance may take it.
    env = command_env(fast_compile=fast_compile, PYTHONFAULTHANDLER="1")
    return subprocess.Popen([sys.executable, "-m", "xlaopt.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _job(args, processes=2, fast_compile: bool = False):
    port = free_port()
    return [_xlaopt("train", *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", processes,
                    "--process-id", i, fast_compile=fast_compile) for i in range(processes)]


def _ledger(ckpt) -> list[dict]:
    path = ckpt / "goodput.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _wait_for_step(ckpt, step: int, procs) -> None:
    """Until process 0's ledger shows `step` done (or a process died early: fail with its output)."""
    deadline = time.monotonic() + TIMEOUT_S
    while max([e["step"] for e in _ledger(ckpt) if "step" in e], default=-1) < step:
        for p in procs:
            assert p.poll() is None, f"exited {p.returncode} early:\n{p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _survivor_stops(survivor, t_fault: float) -> str:
    """The survivor exits EXIT_PEER_LOST within the bound; its one error line."""
    _, err = survivor.communicate(timeout=TIMEOUT_S)
    elapsed = time.monotonic() - t_fault
    errors = [line for line in err.splitlines() if line.startswith("xlaopt train: error:")]
    assert survivor.returncode == EXIT_PEER_LOST and len(errors) == 1, f"exit {survivor.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err
    assert elapsed < BOUND_S, f"stopped {elapsed:.1f} s after the fault (bound {BOUND_S} s)"
    return errors[0]


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _fault_process_1(args, ckpt, step: int, signum) -> str:
    """Run a two-process job, signal process 1 once `step` is done; the survivor's error line."""
    procs = _job(args)
    _wait_for_step(ckpt, step, procs)
    procs[1].send_signal(signum)
    t_fault = time.monotonic()
    try:
        return _survivor_stops(procs[0], t_fault)
    finally:
        _kill(procs)


@pytest.mark.slow  # six two-process jobs
def test_killed_stopped_and_terminated_job_resumes_bit_identical(tmp_path):
    ref, job = tmp_path / "ref", tmp_path / "job"
    common = [*TINY, "--steps", STEPS, "--ckpt-every", EVERY, "--peer-timeout", PEER_TIMEOUT_S]
    reference = _xlaopt("train", *common, "--ckpt", ref, "--processes", 2, "--json", tmp_path / "ref.json")

    # SIGKILL: gloo sees the connection close; the survivor names the silent peer.
    line = _fault_process_1([*common, "--ckpt", job], job, 14, signal.SIGKILL)
    assert "process 1" in line and "dead or stopped" in line and "--resume" in line

    # SIGSTOP: nothing fails, the survivor just waits in the collective; the watchdog stops it.
    line = _fault_process_1([*common, "--ckpt", job, "--resume"], job, 25, signal.SIGSTOP)
    assert f"no step finished for {PEER_TIMEOUT_S} s" in line and "process 1" in line and "SIGSTOP" in line

    # SIGTERM to one process: the job agrees on a step, saves it once and exits 0.
    procs = _job([*common, "--ckpt", job, "--resume", "--json", tmp_path / "term.json"])
    _wait_for_step(job, 35, procs)
    procs[1].send_signal(signal.SIGTERM)
    finish(procs, TIMEOUT_S)
    term = json.loads((tmp_path / "term.json").read_text())
    stop = term["steps"][-1]["step"] + 1
    assert term["stopped_by"] == "SIGTERM" and 35 < stop < STEPS
    assert term["checkpoint"]["committed"][-1] == stop and term["checkpoint"]["saves"][-1]["step"] == stop

    # The last attempt restores that checkpoint, launched as one job that restarts itself: its
    # process 1 (forked from the launcher's zygote, named so) is killed and forked afresh.
    final = _xlaopt("train", *common, "--ckpt", job, "--resume", "--processes", 2, "--restarts", 1,
                    "--json", tmp_path / "job.json")
    _wait_for_step(job, stop + 12, [final])
    killed = job_processes(final.pid)
    os.kill(killed[1], signal.SIGKILL)
    _, err = final.communicate(timeout=TIMEOUT_S)
    assert final.returncode == 0 and "restart 1 of 1" in err, err[-3000:]
    finish([reference], TIMEOUT_S)
    result = json.loads((tmp_path / "job.json").read_text())
    assert result["checkpoint"]["resumed_from"] >= stop
    assert main(["ckpt", "diff", str(ref), str(job), "--step", str(STEPS)]) == 0

    g = result["goodput"]
    assert g["restarts"] == 4
    # Progress lost: the steps after step 10 done before the kill (at >= 14), those after 20 done
    # before the stop (>= 25), those after the SIGTERM's checkpoint + 10 before the last kill; the
    # SIGTERM checkpoint lost nothing.
    assert g["lost_steps"] >= (14 + 1 - 10) + (25 + 1 - 20) + 1
    assert result["steps"][-1]["step"] == STEPS - 1
    assert 0 < g["goodput"] < 1 and g["badput"]["lost_progress_s"] > 0 and g["badput"]["restart_gaps_s"] > 0
    parts = g["productive_s"] + sum(g["badput"].values())
    assert parts == pytest.approx(g["wall_s"], rel=1e-6)
    # Each restart's time to its first step, kept in the ledger: gap, start-up and restore.
    times = g["restart_times"]
    assert len(times) == 4 and sum(r["gap_s"] for r in times) == pytest.approx(g["badput"]["restart_gaps_s"])
    # (An attempt killed before its first save committed restarts from nothing: no restore.)
    assert all(r["setup_s"] > 0 and r["restore_s"] >= 0 and
               r["to_first_step_s"] == pytest.approx(r["gap_s"] + r["setup_s"] + r["restore_s"]) for r in times), times
    assert g["cold_start_s"] > 0
    # A persistent restore reads while the step compiles: the start waits only for what is left of it.
    restores = [e for e in _ledger(job) if "restore_total_s" in e]
    resumed = [e for e in _ledger(job) if e.get("resumed_from")]  # not an attempt killed before its first save
    assert len(restores) == len(resumed) >= 2, restores
    assert all(0 <= e["restore_s"] <= e["restore_total_s"] for e in restores), restores
    reference_g = json.loads((tmp_path / "ref.json").read_text())["goodput"]
    assert reference_g["restarts"] == 0 and reference_g["lost_steps"] == 0


# Process 1 of the job, with a bug injected from outside: its 10th step raises.
_RAISES = """
import sys
from xlaopt.runtime import train
original = train._Run._check_finite
def check(self, step, metrics):
    if step == 10:
        raise RuntimeError("injected failure")
    original(self, step, metrics)
train._Run._check_finite = check
from xlaopt.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a two-process job
def test_a_process_that_raises_stops_its_peers_at_once(tmp_path):
    port = free_port()
    args = ["train", *TINY, "--steps", 200, "--peer-timeout", 60, "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", 2]
    survivor = _xlaopt(*args, "--process-id", 0, "--ckpt", tmp_path / "ckpt", fast_compile=True)
    env = command_env()  # the suite's fast compile: nothing here is compared with another run
    failing = subprocess.Popen([sys.executable, "-c", _RAISES, *map(str, args), "--process-id", "1",
                                "--ckpt", str(tmp_path / "ckpt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        _, failing_err = failing.communicate(timeout=TIMEOUT_S)
        t_fault = time.monotonic()
        _, err = survivor.communicate(timeout=TIMEOUT_S)
    finally:
        _kill([survivor, failing])
    assert failing.returncode == 1 and "RuntimeError: injected failure" in failing_err
    # Told through the coordination service: far sooner than the 60 s peer timeout.
    assert time.monotonic() - t_fault < 10
    errors = [line for line in err.splitlines() if line.startswith("xlaopt train: error:")]
    assert survivor.returncode == EXIT_PEER_LOST and len(errors) == 1, err[-3000:]
    assert "process 1 failed: RuntimeError: injected failure" in errors[0]


COSMOS = ["--model", "cosmos3-tiny", "--set", "num_layers=2", "--dtype", "float32", "--batch-size", "4",
          "--no-progress"]
ELASTIC_STEPS = 6
# Float32. 2 processes x 4 devices against 1 process x 8, the same layout: only the order of
# cross-device sums differs (gloo between processes): a few ulps. After the restart the layout
# differs (the planner's, for 4 devices), so every sum is ordered differently: looser.
LOSS_RTOL_SAME_LAYOUT = 1e-5
LOSS_RTOL_REPLANNED = 1e-4


@pytest.mark.slow  # a two-process job, a one-process reference and a restart on half the devices
def test_job_restarts_on_fewer_processes_with_a_replanned_layout(tmp_path, capsys):
    store = tmp_path / "store"
    make_store(store, get_config("cosmos3-tiny"), 300, seed=1, shard_bytes=32 << 10)
    mesh = ["--mesh", "data=2,fsdp=2,tensor=2"]
    common = [*COSMOS, "--data", store, "--steps", ELASTIC_STEPS]
    # Losses compared within a tolerance, not bits: the suite's -O0 compile.
    reference = _xlaopt("train", *common, *mesh, "--json", tmp_path / "single.json", fast_compile=True)
    procs = _job([*common, *mesh, "--ckpt", tmp_path / "ckpt", "--ckpt-every", 2, "--peer-timeout", 30],
                 fast_compile=True)
    _wait_for_step(tmp_path / "ckpt", 2, procs)
    procs[1].send_signal(signal.SIGKILL)
    _, err = procs[0].communicate(timeout=TIMEOUT_S)
    _kill(procs)
    assert procs[0].returncode == EXIT_PEER_LOST, err[-3000:]
    done = [e for e in _ledger(tmp_path / "ckpt") if "step" in e]

    # What remains is one process of 4 devices: re-plan for it from the old layout (analytic
    # prices: --top 0), for the same rows (the layout's batch would otherwise fill in a row split
    # of its own); the plan says what each device must read to reshard the state.
    finish([reference], TIMEOUT_S)
    one = json.loads((tmp_path / "single.json").read_text())
    text, gen = one["batch"]["text_len"], one["batch"]["gen_len"]
    (tmp_path / "old.json").write_text(json.dumps({"model": "cosmos3-tiny", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}}))
    assert main(["plan", "--model", "cosmos3-tiny", "--set", "num_layers=2", "--from", str(tmp_path / "old.json"),
                 "--topology", "cpu:1x4", "--global-batch", "4", "--seq", str(text + gen), "--top", "0",
                 "--out", str(tmp_path / "four.json")]) == 0
    assert "resharding data=2,fsdp=2,tensor=2 (8 devices) ->" in capsys.readouterr().out
    resumed = _xlaopt("train", *common, "--layout", tmp_path / "four.json", "--text-len", text, "--gen-len", gen,
                      "--ckpt", tmp_path / "ckpt", "--resume", "--json", tmp_path / "resumed.json", fast_compile=True)
    finish([resumed], TIMEOUT_S)
    after = json.loads((tmp_path / "resumed.json").read_text())
    start = after["checkpoint"]["resumed_from"]
    assert start in (2, 4) and after["mesh"] != one["mesh"]
    np.testing.assert_allclose([e["loss"] for e in done], [r["loss"] for r in one["steps"][:len(done)]],
                               rtol=LOSS_RTOL_SAME_LAYOUT, atol=0)
    np.testing.assert_allclose([r["loss"] for r in after["steps"]], [r["loss"] for r in one["steps"][start:]],
                               rtol=LOSS_RTOL_REPLANNED, atol=0)
    # Exactly the uninterrupted run's samples: the same tokens each step and the same data position.
    assert [r["tokens"] for r in after["steps"]] == [r["tokens"] for r in one["steps"][start:]]
    assert after["data"]["state"] == one["data"]["state"] and one["data"]["state"]["cursor"] > 0
    assert after["goodput"]["restarts"] == 1 and after["goodput"]["lost_steps"] == len(done) - start


# A learning rate this large makes the parameters ~1e29 after the first warm-up update, and the
# next forward pass overflows: a deterministic non-finite loss, no fault injected into the code.
BLOW_UP = [*TINY, "--mesh", "data=1", "--steps", "8", "--learning-rate", "1e30", "--ckpt-every", "1"]


def _finite_checkpoint(root, step: int) -> bool:
    step_dir = root / step_dir_name(step)
    return all(np.isfinite(a).all() for a in read_all(step_dir, read_manifest(step_dir)).values())


def test_a_non_finite_loss_stops_the_run_before_saving_it(tmp_path, capsys):
    assert main(["train", *BLOW_UP, "--ckpt", str(tmp_path / "ckpt")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xlaopt train: error: step ") and "is not finite" in err[0]
    bad = int(err[0].split("step ")[1].split(":")[0])
    assert bad > 0 and "--on-nonfinite skip" in err[0]
    # Checkpoints up to the state the bad step started from, all finite; nothing after it.
    assert sorted(int(p.name.split("_")[1]) for p in (tmp_path / "ckpt").glob("step_*"))[-1] == bad
    assert _finite_checkpoint(tmp_path / "ckpt", bad)


def test_skipping_non_finite_steps_leaves_the_state_unchanged(tmp_path):
    out = tmp_path / "skip.json"
    assert main(["train", *BLOW_UP, "--ckpt", str(tmp_path / "ckpt"), "--keep", "8", "--on-nonfinite", "skip",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    nonfinite = [r["step"] for r in result["steps"] if r["skipped"]]
    assert nonfinite and result["skipped_steps"] == len(nonfinite)
    # The updates that would have overflowed never land, so every loss stays finite.
    assert all(np.isfinite(r["loss"]) for r in result["steps"])
    # A skipped step's checkpoint holds the parameters of the one before, bit for bit.
    first = nonfinite[0]
    a, b = (read_all(d, read_manifest(d)) for d in (tmp_path / "ckpt" / step_dir_name(s) for s in (first, first + 1)))
    assert all(a[k].tobytes() == b[k].tobytes() for k in a if k.startswith("params/"))
    assert _finite_checkpoint(tmp_path / "ckpt", 8)


def test_a_process_killed_by_a_signal_takes_the_launched_job_down_at_once(capsys):
    from xlaopt.runtime import launch

    children = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    children[1].kill()
    t0 = time.monotonic()
    code = launch._supervise(children, deadline_s=60)  # not the peers' timeout: the launcher knows
    assert time.monotonic() - t0 < 2 and code == EXIT_PEER_LOST
    assert [c.returncode for c in children] == [-signal.SIGKILL] * 3
    assert "process 1 first (killed by SIGKILL)" in capsys.readouterr().err

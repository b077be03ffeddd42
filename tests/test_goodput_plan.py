"""The checkpoint interval planned from a job's costs and failure rate (`xlaopt goodput plan`):
Daly's interval and goodput against the discrete-event simulation of the same job, time that adds
up, two tiers, costs read from a real run's ledger, and the command."""
import json
import math

import pytest

from xlaopt.cli import main
from xlaopt.errors import UserError
from xlaopt.goodput.costs import JobCosts, job_costs
from xlaopt.goodput.failures import LLAMA3, FailureModel, failure_model
from xlaopt.goodput.interval import Intervals, daly_s, expected_goodput, plan_intervals, young_s
from xlaopt.goodput.simulate import CAUSES, Harness, simulate, simulate_many

HOUR = 3600.0
# A job that fails every 2 hours (8 GPUs of 16 h each), with a minute's save and 5 minutes' restart.
COSTS = JobCosts(step_s=1.0, save_s=60.0, restore_s=120.0, startup_s=150.0, gap_s=30.0)
FAILURES = FailureModel(16.0)
MTBF_S = FAILURES.job_mtbf_s(8)


def test_the_planned_interval_is_dalys_and_the_simulation_gives_dalys_goodput():
    """Daly's closed form assumes exponential failures, restarts that can fail, and a long run: the
    simulation of 1,000 hours gives its goodput within half a point at every interval, and the
    planned interval (Daly's, within Young's first order) beats half and twice itself."""
    assert MTBF_S == 2 * HOUR
    planned, loss = plan_intervals(COSTS, FAILURES, 8)
    assert planned == Intervals(round(daly_s(60.0, MTBF_S)), None) and loss == 1.0
    assert daly_s(60.0, MTBF_S) == pytest.approx(young_s(60.0, MTBF_S), rel=0.05)
    simulated = {}
    for every in (planned.every // 2, planned.every, planned.every * 2):
        intervals = Intervals(every)
        simulated[every] = simulate_many(COSTS, intervals, MTBF_S, 1000 * HOUR, seeds=8)["goodput"]
        assert simulated[every] == pytest.approx(expected_goodput(COSTS, intervals, MTBF_S), abs=0.005)
    assert simulated[planned.every] > max(simulated[planned.every // 2], simulated[planned.every * 2])
    # Host work outside each step's timed part: longer segments, and none of it counts.
    busy = JobCosts(step_s=1.0, save_s=60.0, restore_s=120.0, startup_s=150.0, gap_s=30.0, step_overhead_s=0.5)
    intervals = plan_intervals(busy, FAILURES, 8)[0]
    assert intervals.every == round(daly_s(60.0, MTBF_S) / 1.5)
    assert simulate_many(busy, intervals, MTBF_S, 1000 * HOUR, seeds=8)["goodput"] == pytest.approx(
        expected_goodput(busy, intervals, MTBF_S), abs=0.005)


def test_a_simulated_run_accounts_for_every_second():
    costs = JobCosts(step_s=2.0, save_s=30.0, restore_s=300.0, startup_s=200.0, gap_s=60.0,
                     local_save_s=3.0, local_restore_s=20.0)
    run = simulate(costs, Intervals(600, 60), MTBF_S, 200 * HOUR, seed=1, local_loss=0.3)
    assert run["restarts"] > 50 and set(run["badput"]) == set(CAUSES)
    assert all(v >= 0 for v in run["badput"].values())
    assert run["productive_s"] + sum(run["badput"].values()) == pytest.approx(run["wall_s"], rel=1e-9)
    assert run["productive_s"] % costs.step_s == pytest.approx(0, abs=1e-6)  # whole steps, kept


def test_a_local_tier_copied_to_a_peer_serves_nearly_every_restart():
    """With a cheap local tier the job saves often and restarts from it; only a node and its peer
    failing together sends it to the persistent tier. Without the peer copy every failure does."""
    two = JobCosts(step_s=1.0, save_s=60.0, restore_s=120.0, startup_s=150.0, gap_s=30.0,
                   local_save_s=2.0, local_restore_s=10.0)
    planned, loss = plan_intervals(two, FAILURES, 8, gpus_per_node=8, peer_copy=True)
    assert planned.local_every < planned.every and planned.every % planned.local_every == 0
    assert 0 < loss < 0.5
    _, no_peer = plan_intervals(two, FAILURES, 8, gpus_per_node=8, peer_copy=False)
    assert no_peer == 1.0
    one_tier = simulate_many(COSTS, plan_intervals(COSTS, FAILURES, 8)[0], MTBF_S, 500 * HOUR, seeds=8)
    both = simulate_many(two, planned, MTBF_S, 500 * HOUR, seeds=8, local_loss=loss)
    assert both["goodput"] > one_tier["goodput"] + 0.05
    # Work lost a failure: half a local interval, and half a persistent one for the failures that
    # lost the local copy, against half the one tier's interval (to first order).
    single = plan_intervals(COSTS, FAILURES, 8)[0].every
    ratio = both["badput"]["lost_progress_s"] / one_tier["badput"]["lost_progress_s"]
    assert ratio == pytest.approx((planned.local_every + loss * planned.every) / single, rel=0.2)


def test_a_harness_kills_as_many_times_as_it_says_and_the_run_ends_on_its_steps():
    """The fault-injection harness's rule (`experiments/fault_injection.py`): each attempt killed
    20-400 steps past the furthest step reached, 12 times, the run over when its 3,000 steps are
    done; each step's host work outside its timed part is `other` time, as the ledger counts it."""
    costs = JobCosts(step_s=0.02, save_s=0.01, restore_s=0.05, startup_s=5.0, gap_s=0.2, step_overhead_s=0.005,
                     cold_start_s=9.0)
    run = simulate(costs, Intervals(100), math.inf, math.inf, seed=3, harness=Harness(3000, 12))
    assert run["restarts"] == 12 and run["productive_s"] == pytest.approx(3000 * 0.02)
    assert run["productive_s"] + sum(run["badput"].values()) == pytest.approx(run["wall_s"], rel=1e-9)
    executed = (run["productive_s"] + run["badput"]["lost_progress_s"]) / 0.02
    assert run["badput"]["other_s"] == pytest.approx(executed * 0.005)
    # The first start is the cold one, the 12 restarts' the warm one.
    assert run["badput"]["startup_compile_s"] == pytest.approx(9.0 + 12 * 5.0)
    # Lost a kill: on average half a checkpoint interval's steps, and never more than one.
    assert 0 < run["badput"]["lost_progress_s"] / 0.02 <= 12 * 100


def test_the_llama3_preset_is_its_published_rate():
    assert failure_model("llama3") is LLAMA3
    # 419 unexpected interruptions in 54 days of 16,384 GPUs: one every 3.09 hours for the job.
    assert LLAMA3.job_mtbf_s(16384) / HOUR == pytest.approx(54 * 24 / 419)
    assert failure_model("20000").mtbf_gpu_h == 20000


@pytest.mark.parametrize("setting, phrase", [("0", r"between 10 and 1e\+08 hours"), ("-5", "between 10"),
                                             ("1e12", "between 10"), ("nan", "between 10"), ("often", "give an MTBF")])
def test_an_mtbf_out_of_reason_is_refused(setting, phrase):
    with pytest.raises(UserError, match=phrase):
        failure_model(setting)


def test_an_interval_no_longer_than_its_save_is_refused():
    with pytest.raises(UserError, match=r"--every 50: 50 steps take 50 s, not more than one save \(60 s, with its write\); give at "
                                        r"least 61 steps"):
        Intervals(50).check(COSTS)


def test_a_write_behind_the_loop_floors_the_interval_and_commits_late():
    """An async save's write must finish before the next save and before its checkpoint counts: the
    interval is at least the write, and a failure during it restores the checkpoint before."""
    slow = JobCosts(step_s=1.0, save_s=60.0, restore_s=120.0, startup_s=150.0, gap_s=30.0, write_s=2000.0)
    planned, _ = plan_intervals(slow, FAILURES, 8)
    assert planned.every == 2001
    with pytest.raises(UserError, match=r"--every 1000: .* not more than one save \(2e\+03 s, with its write\)"):
        Intervals(1000).check(slow)
    instant = JobCosts(step_s=1.0, save_s=60.0, restore_s=120.0, startup_s=150.0, gap_s=30.0)
    lost = [simulate_many(c, Intervals(2001), MTBF_S, 500 * HOUR, seeds=8)["badput"]["lost_progress_s"]
            for c in (instant, slow)]
    assert lost[1] > lost[0] * 1.3  # a failure in the write window loses a whole interval more


def test_costs_come_from_a_real_runs_ledger_and_flags_fill_in(tmp_path):
    """A short `xlaopt train` with checkpoints, stopped and resumed: its ledger gives the step,
    save, restore, start-up and gap times; what it lacks is named by its flag."""
    ckpt = tmp_path / "ckpt"
    tiny = ["train", "--model", "llama-tiny", "--set", "num_layers=1", "--set", "d_model=64", "--set", "mlp_dim=128",
            "--set", "vocab_size=256", "--mesh", "data=1", "--dtype", "float32", "--batch-size", "2", "--text-len", "16",
            "--no-progress", "--ckpt", str(ckpt), "--ckpt-every", "2"]
    assert main([*tiny, "--steps", "4"]) == 0
    with pytest.raises(UserError, match=r"no restore time \(the ledger has none\): give --restore-s SECONDS"):
        job_costs(_ledger(ckpt))
    assert main([*tiny, "--steps", "8", "--resume"]) == 0
    costs = job_costs(_ledger(ckpt))
    assert all(getattr(costs, f) > 0 for f in ("step_s", "save_s", "restore_s", "startup_s", "cold_start_s"))
    assert costs.gap_s >= 0  # both attempts ran in this one process, whose start each dates itself from
    assert dict(costs.sources) == dict.fromkeys(("step_s", "save_s", "restore_s", "startup_s", "gap_s",
                                                 "cold_start_s"), "the run's ledger")
    out = tmp_path / "plan.json"
    assert main(["goodput", "plan", "--ledger", str(ckpt), "--gap-s", "60", "--gpus", "1024", "--seeds", "20",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["cost_sources"]["gap_s"] == "given" and report["costs"]["gap_s"] == 60
    assert report["costs"]["step_s"] == costs.step_s


def _ledger(ckpt):
    return [json.loads(line) for line in (ckpt / "goodput.jsonl").read_text().splitlines()]


def test_the_command_prints_the_plan_beside_given_intervals(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["goodput", "plan", "--topology", "h100:128x8", "--step-s", "2.5", "--save-s", "4", "--restore-s", "90",
            "--startup-s", "180", "--gap-s", "60", "--hours", "72", "--seeds", "50", "--json", str(out)]
    assert main([*args, "--every", "100", "--every", "3000"]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["gpus"] == 1024 and report["mtbf_source"].startswith("Llama 3")
    planned, *given = report["intervals"]
    assert [g["every"] for g in given] == [100, 3000]
    assert planned["every"] == round(daly_s(4.0, report["job_mtbf_s"]) / 2.5)
    assert planned["simulated"]["goodput"] >= max(g["simulated"]["goodput"] for g in given)
    assert "a job of 1,024 GPUs fails every" in text and "planned" in text and "--every 3000" in text
    assert math.isclose(planned["daly_goodput"], expected_goodput(JobCosts(2.5, 4, 90, 180, 60),
                                                                  Intervals(planned["every"]), report["job_mtbf_s"]))


class _Manager:
    """A persistent tier that records its saves; a save blocks 2 ms, its write takes 30 ms more."""

    def __init__(self):
        self.saved = []

    def save(self, step, state, meta):
        from xlaopt.checkpoint.manager import SaveInfo

        self.saved.append(step)
        return SaveInfo(step, 1000, 0.002)

    def wait(self):
        import time

        time.sleep(0.03)


class _Local:
    def __init__(self):
        self.saved = []

    def save(self, step, state, meta):
        self.saved.append(step)
        return 0.001


class _Ledger:
    def __init__(self):
        self.events = []

    def record(self, **event):
        self.events.append(event)


def test_ckpt_every_auto_probes_plans_with_the_planner_and_saves_on_its_plan():
    """`train --ckpt-every auto`'s schedule: two local probes and a persistent one after 10 steps
    into the attempt, then process 0's plan (`plan_intervals` on the probes' costs), then saves
    at its intervals, a local save skipped where a persistent one is due."""
    import contextlib

    from xlaopt.goodput import auto
    from xlaopt.runtime.saving import CheckpointOptions, Saves

    failures = FailureModel(0.2)  # no real device fails this often: a plan whose intervals a test can see
    ckpt = CheckpointOptions("unused", "auto", local="unused", local_every="auto", local_peers=1, failures=failures)
    manager, local, ledger = _Manager(), _Local(), _Ledger()
    saves = Saves(ckpt, manager, local, ledger, 100, contextlib.nullcontext, {"setup_s": 3.0})
    step_times = [0.05] + [0.01] * 400  # the first step warms up
    for done in range(101, 501):
        saves.after(done, 500, None, dict, False, lambda done=done: step_times[:done - 100])
    planned = saves.planned
    assert manager.saved[0] == 110 and local.saved[:2] == [104, 107]
    costs = JobCosts(**planned["costs"])
    assert costs.step_s == pytest.approx(0.01) and costs.save_s == 0.002 and costs.local_save_s == 0.001
    assert costs.write_s >= 0.03  # the probe's write, waited for
    import jax

    expected, _ = plan_intervals(costs, failures, jax.device_count(), jax.local_device_count(), peer_copy=True)
    assert (planned["every"], planned["local_every"]) == (expected.every, expected.local_every)
    every, local_every = expected.every, expected.local_every
    assert 1 < local_every < every < 400 and every % local_every == 0
    assert manager.saved == [110] + [s for s in range(111, 501) if s % every == 0 or s == 500]
    assert local.saved == [104, 107] + [s for s in range(111, 501) if s % local_every == 0 and s % every and s != 500]
    assert [e for e in ledger.events if "planned" in e][0]["planned"]["every"] == every
    assert auto.describe(planned).startswith(f"checkpoint intervals planned (Daly's): persistent every {every} steps")

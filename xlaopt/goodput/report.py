"""`xlaopt goodput plan`'s report: the planned intervals beside any given ones, each with Daly's
expected goodput and a simulated run's, and the costs and failure rate they came from."""
from __future__ import annotations

import dataclasses

from xlaopt.goodput.costs import JobCosts
from xlaopt.goodput.failures import HOUR_S, failure_model
from xlaopt.goodput.interval import Intervals, expected_goodput, local_loss_probability, plan_intervals
from xlaopt.goodput.simulate import CAUSES, simulate_many


def plan_report(costs: JobCosts, mtbf: str, gpus: int, gpus_per_node: int, peer_copy: bool, hours: float,
                seeds: int, given: tuple[int, ...] = ()) -> dict:
    failures = failure_model(mtbf)
    mtbf_s = failures.job_mtbf_s(gpus)
    planned, loss = plan_intervals(costs, failures, gpus, gpus_per_node, peer_copy)
    rows = [("planned", planned)]
    for every in given:
        intervals = Intervals(every, planned.local_every)  # with two tiers, K steps of the persistent one
        intervals.check(costs)
        rows.append((f"--every {every}", intervals))

    def priced(name: str, intervals: Intervals) -> dict:
        local_loss = loss if intervals.local_every is None else local_loss_probability(
            costs, intervals.local_every * costs.step_s, failures.mtbf_gpu_h * HOUR_S, gpus_per_node, peer_copy)
        sim = simulate_many(costs, intervals, mtbf_s, hours * HOUR_S, seeds, local_loss)
        return {"name": name, **dataclasses.asdict(intervals), "every_s": intervals.every * costs.step_s,
                "daly_goodput": expected_goodput(costs, intervals, mtbf_s), "local_loss": local_loss, "simulated": sim}

    return {"gpus": gpus, "gpus_per_node": gpus_per_node, "mtbf_gpu_h": failures.mtbf_gpu_h,
            "mtbf_source": failures.source, "job_mtbf_s": mtbf_s, "hours": hours, "peer_copy": peer_copy,
            "costs": {k: v for k, v in dataclasses.asdict(costs).items() if k != "sources"},
            "cost_sources": dict(costs.sources), "intervals": [priced(n, i) for n, i in rows]}


def format_plan(report: dict) -> str:
    costs, sources = report["costs"], report["cost_sources"]
    lines = [f"failures: MTBF {report['mtbf_gpu_h']:,.0f} h a GPU ({report['mtbf_source']}): a job of "
             f"{report['gpus']:,} GPUs fails every {report['job_mtbf_s'] / HOUR_S:.3g} h on average",
             "costs: " + ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {costs[name]:.3g} s ({source})"
                                   for name, source in sources.items()),
             f"{'interval':<14}{'every':>8}{'local':>7}{'lasting':>10}{'Daly':>8}  simulated {report['hours']:g} h "
             f"({report['intervals'][0]['simulated']['seeds']} runs): goodput [p5, p95], restarts"]
    for row in report["intervals"]:
        sim, daly = row["simulated"], row["daly_goodput"]
        lines.append(f"{row['name']:<14}{row['every']:>8}{row['local_every'] or '-':>7}{_duration(row['every_s']):>10}"
                     f"{'-' if daly is None else f'{100 * daly:.1f}%':>8}  {100 * sim['goodput']:.1f}% "
                     f"[{100 * sim['goodput_p5']:.1f}, {100 * sim['goodput_p95']:.1f}], {sim['restarts']:.2f}")
    planned = report["intervals"][0]["simulated"]
    lines.append("planned, badput (mean hours of the run): " + ", ".join(
        f"{cause.removesuffix('_s').replace('_', ' ')} {planned['badput'][cause] / HOUR_S:.3g}" for cause in CAUSES))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.3g} min" if seconds < 2 * HOUR_S else f"{seconds / HOUR_S:.3g} h"

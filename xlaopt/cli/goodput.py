"""`xlaopt goodput plan`: the checkpoint interval of each tier, and the goodput it gives."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of, write_json
from xlaopt.errors import UserError

HORIZON_H_RANGE = (0.01, 24 * 365 * 10)


@dataclasses.dataclass(frozen=True)
class GoodputPlanRequest:
    ledger: str | None
    step_s: float | None
    save_s: float | None
    restore_s: float | None
    startup_s: float | None
    gap_s: float | None
    write_s: float | None
    step_overhead_s: float | None
    local_save_s: float | None
    local_restore_s: float | None
    cold_start_s: float | None
    mtbf: str
    gpus: int | None
    topology: str | None
    gpus_per_node: int
    peer_copy: bool
    hours: float
    seeds: int
    every: tuple[int, ...]
    json: str | None


def register(sub) -> None:
    p = sub.add_parser("goodput", help="plan a long job's checkpoint intervals from its costs and a failure rate")
    what = p.add_subparsers(dest="goodput_command", required=True)
    q = what.add_parser("plan", help="each tier's checkpoint interval (Daly's), its expected goodput, and a "
                                     "simulation of the run failure by failure")
    q.add_argument("--ledger", default=None, metavar="CKPT_DIR",
                   help="a run's checkpoint directory: its goodput ledger gives the step, save, restore, start-up "
                        "and gap times it measured (a flag below overrides one)")
    for flag, what_it_is in (("--step-s", "one training step"), ("--save-s", "a persistent save's blocking time"),
                             ("--restore-s", "a restore from the persistent tier"),
                             ("--startup-s", "a restart's start-up to its first step, restore excluded"),
                             ("--gap-s", "from a failure to the next attempt's start"),
                             ("--write-s", "a persistent save's write behind the loop, which the next save waits "
                                           "for (default 0)"),
                             ("--step-overhead-s", "a step's host work outside its timed part (default 0)"),
                             ("--local-save-s", "a local save's blocking time (a second, local tier)"),
                             ("--local-restore-s", "a restore from the local tier"),
                             ("--cold-start-s", "the job's first start to its first step, when not a restart's "
                                                "(default: --startup-s)")):
        q.add_argument(flag, type=float, default=None, metavar="SECONDS", help=what_it_is)
    q.add_argument("--mtbf", default="llama3", metavar="HOURS|llama3",
                   help="mean time between failures per GPU, in hours, or a published run's rate: llama3 (default; "
                        "419 unexpected interruptions in 54 days on 16,384 H100, about 50,700 h)")
    q.add_argument("--gpus", type=int, default=None, help="the job's GPUs (or --topology)")
    q.add_argument("--topology", default=None, metavar="TOPOLOGY", help="e.g. h100:128x8: its GPUs and GPUs a node")
    q.add_argument("--gpus-per-node", type=int, default=8)
    q.add_argument("--no-peer-copy", dest="peer_copy", action="store_false",
                   help="the local tier keeps no copy on a peer node: a failed node's shard is gone")
    q.add_argument("--hours", type=float, default=72.0, help="the simulated run's length (default 72)")
    q.add_argument("--seeds", type=int, default=200, help="simulated runs (default 200)")
    q.add_argument("--every", type=int, action="append", default=[], metavar="K",
                   help="also price a persistent interval of K steps (repeatable)")
    q.add_argument("--json", default=None, metavar="OUT")


def main(args: argparse.Namespace) -> int:
    return run(request_of(GoodputPlanRequest, args))


def run(request: GoodputPlanRequest) -> int:
    from xlaopt.goodput.report import format_plan, plan_report

    gpus, per_node = _cluster(request)
    if not HORIZON_H_RANGE[0] <= request.hours <= HORIZON_H_RANGE[1]:
        raise UserError(f"--hours {request.hours:g}: simulate between {HORIZON_H_RANGE[0]:g} and "
                        f"{HORIZON_H_RANGE[1]:g} hours")
    if request.seeds < 1:
        raise UserError(f"--seeds {request.seeds}: must be at least 1")
    report = plan_report(_costs(request), request.mtbf, gpus, per_node, request.peer_copy, request.hours,
                         request.seeds, request.every)
    print(format_plan(report))
    write_json(request.json, report)
    return 0


def _cluster(request: GoodputPlanRequest) -> tuple[int, int]:
    if (request.gpus is None) == (request.topology is None):
        raise UserError("give the job's size: --gpus N or --topology KIND:NODESxGPUS (one of them)")
    if request.topology is not None:
        from xlaopt.analysis.topology import parse_topology

        topology = parse_topology(request.topology)
        return topology.num_devices, topology.devices_per_node
    if request.gpus < 1 or request.gpus_per_node < 1:
        raise UserError(f"--gpus {request.gpus} --gpus-per-node {request.gpus_per_node}: both must be at least 1")
    return request.gpus, request.gpus_per_node


def _costs(request: GoodputPlanRequest):
    from xlaopt.goodput.costs import FIELDS, job_costs
    from xlaopt.runtime import goodput

    ledger = goodput.read(request.ledger) if request.ledger is not None else None
    return job_costs(ledger, **{name: getattr(request, name) for name in FIELDS})

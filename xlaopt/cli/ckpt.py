"""`xlaopt ckpt ls|verify|inspect|diff`: checkpoint directories."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of, write_json


@dataclasses.dataclass(frozen=True)
class CkptRequest:
    command: str  # ls, verify, inspect or diff
    dirs: tuple[str, ...]  # the checkpoint directory; diff's two
    step: int | None  # None: every step (verify), each one's newest (inspect, diff); ls lists them all
    json: str | None


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="checkpoint directories").add_subparsers(dest="ckpt_command", required=True)
    p = ckpt.add_parser("ls", help="committed steps with sizes, and debris of interrupted saves")
    p.add_argument("dir")
    p.set_defaults(step=None)
    p.add_argument("--json", default=None, metavar="OUT")
    p = ckpt.add_parser("verify", help="check every file and chunk checksum; exits 1 on any fault")
    p.add_argument("dir")
    p.add_argument("--step", type=int, default=None, help="only this step (default: all)")
    p.add_argument("--json", default=None, metavar="OUT")
    p = ckpt.add_parser("inspect", help="a step's manifest: leaves, shapes, dtypes, shardings, run metadata")
    p.add_argument("dir")
    p.add_argument("--step", type=int, default=None, help="default: the newest")
    p.add_argument("--json", default=None, metavar="OUT")
    p = ckpt.add_parser("diff", help="exit 0 when two checkpoints hold bit-identical leaves and data position, "
                                     "1 with the leaves that differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--step", type=int, default=None, help="this step in both (default: each one's newest)")
    p.add_argument("--json", default=None, metavar="OUT")


def main(args: argparse.Namespace) -> int:
    dirs = (args.a, args.b) if args.ckpt_command == "diff" else (args.dir,)
    return run(request_of(CkptRequest, args, command=args.ckpt_command, dirs=dirs))


def run(request: CkptRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.checkpoint import catalog

    if request.command == "ls":
        result = catalog.listing(*request.dirs)
        print(f"{'step':>10} {'size':>10} {'leaves':>7} {'files':>6} {'procs':>5}")
        for r in result["steps"]:
            print(f"{r['step']:>10} {r['bytes'] / 1e6:>8.1f}MB {r['leaves']:>7} {r['files']:>6} {r['process_count']:>5}")
        if result["debris"]:
            print(f"interrupted saves (removed at the next training start): {', '.join(result['debris'])}")
        code = 0
    elif request.command == "verify":
        result = catalog.verify(*request.dirs, request.step)
        for step, faults in result["steps"].items():
            print(f"step {step}: " + ("ok" if not faults else f"{len(faults)} fault(s)"))
            for fault in faults:
                print(f"  {fault}")
        for step, why in result.get("in_progress", {}).items():
            print(f"step {step}: a save the job's stop interrupted, passed over by restores ({why})")
        code = 0 if result["ok"] else 1
    elif request.command == "diff":
        a, b = request.dirs
        result = catalog.diff(a, b, request.step)
        print(f"{a} (step {result['steps'][0]}) vs {b} (step {result['steps'][1]}): "
              + ("identical" if result["identical"] else "differ"))
        for what in ("differing", "only_in_a", "only_in_b"):
            for name in result[what]:
                print(f"  {what.replace('_', ' ')}: {name}")
        if not result["data_state_equal"]:
            print("  the data positions differ")
        code = 0 if result["identical"] else 1
    else:
        result = catalog.describe(*request.dirs, request.step)
        print(f"step {result['step']}: {len(result['leaves'])} leaves, {sum(result['files'].values()) / 1e6:.1f} MB "
              f"in {len(result['files'])} files, saved by {result['process_count']} process(es)")
        for leaf in result["leaves"]:
            sharding = leaf["sharding"]
            where = f"  {sharding['spec']} on {sharding['mesh']}" if sharding else ""
            print(f"  {leaf['name']:<56} {leaf['dtype']:>8} {str(leaf['shape']):<16}{where}")
        meta = result["meta"]
        if meta.get("model"):
            print(f"model {meta['model']}, seed {meta.get('seed')}, data position {meta.get('data')}")
        code = 0
    write_json(request.json, result)
    return code

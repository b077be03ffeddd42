"""`xlaopt bench checkpoint|data`: benchmarks against the anchors."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of, write_json
from xlaopt.errors import UserError
from xlaopt.mesh import request_cpu_devices
from xlaopt.models.registry import get_config


@dataclasses.dataclass(frozen=True)
class CheckpointBench:
    size_gb: float
    repeats: int
    devices: int
    dir: str | None
    json: str | None


@dataclasses.dataclass(frozen=True)
class DataBench:
    store: str | None
    mix: str | None
    steps: int
    repeats: int
    io: bool
    dir: str | None  # --io's scratch directory
    json: str | None


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks against the anchors").add_subparsers(dest="bench_command",
                                                                                         required=True)
    p = bench.add_parser("checkpoint", help="disk vs xlaopt vs Orbax: save and cold restore of one sharded tree")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices the tree is sharded over")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: /tmp)")
    p.add_argument("--json", default=None, metavar="OUT")
    p = bench.add_parser("data", help="the xlaopt loader vs Grain feeding the same cosmos3-tiny training step")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--store", "--data", default=None, metavar="DIR",
                      help="a sample store (default: a synthetic one in a temp dir)")
    rows.add_argument("--mix", default=None, metavar="NAME",
                      help="a named mix's store (made once in the cache), in rows of the mix's budget")
    p.add_argument("--steps", type=int, default=30, help="timed training steps per contender and round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--io", action="store_true",
                   help="instead: the loader vs the disk on real-size clips (a ~2.5 GB synthetic store of 720p "
                        "video latents unless --store), cold page cache; no training")
    p.add_argument("--dir", default=None, help="--io: where to make the synthetic store (default: the temp dir)")
    p.add_argument("--json", default=None, metavar="OUT")


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.benchmarks import disk

    disk.allow_system_drop()  # cold reads via drop_caches where root; library callers evict per file
    if args.bench_command == "checkpoint":
        return checkpoint(request_of(CheckpointBench, args))
    return data(request_of(DataBench, args))


def checkpoint(request: CheckpointBench) -> int:
    if request.devices < 1:
        raise UserError(f"--devices {request.devices}: need at least one device")
    request_cpu_devices(request.devices)
    from xlaopt.benchmarks import checkpoint as bench

    result = bench.run(request.size_gb, request.repeats, request.dir, progress=print)
    print(bench.format_table(result))
    write_json(request.json, result)
    return 0


def data(request: DataBench) -> int:
    store, row = request.store, None
    if request.mix is not None:
        from xlaopt.benchmarks.data import MODEL
        from xlaopt.data.mixes import get_mix
        from xlaopt.data.synthetic_store import mix_store

        mix = get_mix(request.mix)
        store, row = str(mix_store(get_config(MODEL), mix)), mix.row
    if request.io:
        from xlaopt.benchmarks import data_io

        result = data_io.run_io(store, request.repeats, progress=print, scratch_dir=request.dir)
        print(data_io.format_io_table(result))
    else:
        from xlaopt.benchmarks import data as bench

        result = bench.run(store, request.steps, request.repeats, progress=print, row=row)
        print(bench.format_table(result))
    write_json(request.json, result)
    return 0

"""`xlaopt parity`: NVIDIA's reference and xlaopt on the same sample, per-modality differences."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of, write_json


@dataclasses.dataclass(frozen=True)
class ParityRequest:
    diffusers: str
    seed: int
    inputs: str | None  # a sample's .npz instead of one built from `seed`
    dump: str | None
    json: str | None
    dtype: str
    rope_table: str


def register(sub) -> None:
    p = sub.add_parser("parity", help="NVIDIA's reference (diffusers, torch, CPU) and xlaopt on the same sample: "
                                      "per-modality differences (needs xlaopt[parity])")
    p.add_argument("--diffusers", required=True, metavar="DIR", help="a saved Cosmos3OmniTransformer directory")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--seed", type=int, default=0, help="build a sample covering every modality from this seed")
    source.add_argument("--inputs", default=None, metavar="SAMPLE.npz",
                        help="the reference forward's keyword arguments (lists as name_0, name_1, ...)")
    p.add_argument("--dump", default=None, metavar="OUT.npz", help="xlaopt's predictions (vision_0, sound_0, ...)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="xlaopt's compute dtype")
    p.add_argument("--rope-table", default="reference", choices=("reference", "xlaopt"),
                   help="rotary frequencies: the reference's fp32 table (default) or xlaopt's own")


def main(args: argparse.Namespace) -> int:
    return run(request_of(ParityRequest, args))


def run(request: ParityRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX (nor torch).
    from xlaopt.interop.parity import format_parity, run_parity

    result = run_parity(diffusers_dir=request.diffusers, seed=request.seed, inputs_npz=request.inputs, dump=request.dump,
                        dtype=request.dtype, rope_table=request.rope_table)
    print(format_parity(result))
    write_json(request.json, result)
    return 0 if result["ok"] else 1

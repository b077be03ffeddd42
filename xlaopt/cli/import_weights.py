"""`xlaopt import-weights`: a diffusers Cosmos3OmniTransformer directory to an xlaopt checkpoint."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of
from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec, request_cpu_devices


@dataclasses.dataclass(frozen=True)
class ImportRequest:
    source: tuple[str, str]  # --from FORMAT DIR
    out: str
    mesh: str
    name: str


def register(sub) -> None:
    p = sub.add_parser("import-weights", help="a diffusers Cosmos3OmniTransformer directory -> an xlaopt "
                                              "checkpoint, placed on a mesh")
    p.add_argument("--from", dest="source", nargs=2, metavar=("FORMAT", "DIR"), required=True,
                   help="the format (diffusers) and directory of the weights")
    p.add_argument("--out", required=True, metavar="CKPT", help="the xlaopt checkpoint directory to write")
    p.add_argument("--mesh", default="", help="place the parameters on this mesh (e.g. fsdp=4,tensor=2)")
    p.add_argument("--name", default="cosmos3-diffusers", help="the model name recorded in the checkpoint")


def main(args: argparse.Namespace) -> int:
    return run(request_of(ImportRequest, args))


def run(request: ImportRequest) -> int:
    fmt, directory = request.source
    if fmt != "diffusers":
        raise UserError(f"--from {fmt}: only 'diffusers' (a Cosmos3OmniTransformer directory) is supported")
    mesh = MeshSpec.parse(request.mesh)
    request_cpu_devices(mesh.num_devices)
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX (nor torch).
    from xlaopt.interop.checkpoint import import_to_checkpoint

    info = import_to_checkpoint(directory, request.out, mesh, name=request.name)
    print(f"imported {info['tensors']} tensors ({info['params'] / 1e6:.1f}M parameters) from {directory} "
          f"into {request.out} step {info['step']} on mesh {mesh}")
    return 0

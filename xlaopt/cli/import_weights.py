"""`xlaopt import-weights`: a diffusers Cosmos3OmniTransformer directory, or a Hugging Face Llama
one (transformers' `LlamaForCausalLM`), to an xlaopt checkpoint."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of
from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec, request_cpu_devices

FORMATS = {"diffusers": "cosmos3-diffusers", "hf-llama": "hf-llama"}  # format -> default model name


@dataclasses.dataclass(frozen=True)
class ImportRequest:
    source: tuple[str, str]  # --from FORMAT DIR
    out: str
    mesh: str
    name: str | None


def register(sub) -> None:
    p = sub.add_parser("import-weights", help="a diffusers Cosmos3OmniTransformer directory or a Hugging Face "
                                              "Llama one -> an xlaopt checkpoint, placed on a mesh")
    p.add_argument("--from", dest="source", nargs=2, metavar=("FORMAT", "DIR"), required=True,
                   help="the format (diffusers: Cosmos 3; hf-llama: config.json and safetensors) and directory")
    p.add_argument("--out", required=True, metavar="CKPT", help="the xlaopt checkpoint directory to write")
    p.add_argument("--mesh", default="", help="place the parameters on this mesh (e.g. fsdp=4,tensor=2)")
    p.add_argument("--name", default=None, help="the model name recorded in the checkpoint (default: "
                                               "cosmos3-diffusers, hf-llama)")


def main(args: argparse.Namespace) -> int:
    return run(request_of(ImportRequest, args))


def run(request: ImportRequest) -> int:
    fmt, directory = request.source
    if fmt not in FORMATS:
        raise UserError(f"--from {fmt}: the formats are {', '.join(FORMATS)} (a Cosmos3OmniTransformer directory, a "
                        f"Hugging Face LlamaForCausalLM one)")
    mesh = MeshSpec.parse(request.mesh)
    request_cpu_devices(mesh.num_devices)
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX (nor torch).
    from xlaopt.interop import checkpoint

    write = checkpoint.import_to_checkpoint if fmt == "diffusers" else checkpoint.import_llama_to_checkpoint
    info = write(directory, request.out, mesh, name=request.name or FORMATS[fmt])
    print(f"imported {info['tensors']} tensors ({info['params'] / 1e6:.1f}M parameters) from {directory} "
          f"into {request.out} step {info['step']} on mesh {mesh}")
    return 0

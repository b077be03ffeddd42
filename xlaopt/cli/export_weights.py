"""`xlaopt export-weights`: an xlaopt checkpoint's parameters in another framework's layout: a
Hugging Face Llama directory (transformers' `LlamaForCausalLM`) or NVIDIA's diffusers
`Cosmos3OmniTransformer` one."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of
from xlaopt.errors import UserError

FORMATS = ("hf-llama", "diffusers")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ExportRequest:
    ckpt: str
    ckpt_step: int | None
    target: tuple[str, str]  # --to FORMAT DIR
    dtype: str


def register(sub) -> None:
    p = sub.add_parser("export-weights", help="an xlaopt checkpoint's parameters -> a Hugging Face Llama or a "
                                              "diffusers Cosmos 3 directory")
    p.add_argument("--ckpt", required=True, metavar="DIR", help="the checkpoint (`xlaopt train` or `import-weights`)")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N", help="its step (default: the newest)")
    p.add_argument("--to", dest="target", nargs=2, metavar=("FORMAT", "DIR"), required=True,
                   help="hf-llama (a decoder's checkpoint) or diffusers (one imported from diffusers), and a new "
                        "directory to write")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the exported tensors' dtype")


def main(args: argparse.Namespace) -> int:
    return run(request_of(ExportRequest, args))


def run(request: ExportRequest) -> int:
    fmt, out = request.target
    if fmt not in FORMATS:
        raise UserError(f"--to {fmt}: the formats are {', '.join(FORMATS)}")
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.interop import checkpoint

    export = checkpoint.export_llama_checkpoint if fmt == "hf-llama" else checkpoint.export_checkpoint
    written = export(request.ckpt, out, request.ckpt_step, request.dtype)
    print(f"exported {request.ckpt} as {fmt} into {out}: {', '.join(sorted(written))}")
    return 0

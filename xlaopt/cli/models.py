"""`xlaopt models`: the registered models with their parameter counts."""
from __future__ import annotations

import argparse
import dataclasses

from xlaopt.cli.requests import request_of, write_json


@dataclasses.dataclass(frozen=True)
class ModelsRequest:
    json: str | None


def register(sub) -> None:
    p = sub.add_parser("models", help="registered models with parameter counts")
    p.add_argument("--json", default=None, metavar="OUT")


def main(args: argparse.Namespace) -> int:
    return run(request_of(ModelsRequest, args))


def run(request: ModelsRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.build import build_program
    from xlaopt.models.registry import get_config, registered_models
    from xlaopt.step import param_count

    rows = []
    shape_fields = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")
    for name in registered_models():
        c = get_config(name)
        program = build_program(c)
        # A CNN has no transformer shape: its fields are absent (None), printed as "-".
        rows.append({"name": name, "family": c.family, "param_count": param_count(program),
                     **{f: getattr(c, f, None) for f in shape_fields}})
    cell = lambda v: "-" if v is None else v  # noqa: E731
    print(f"{'model':<16}{'family':>8}{'params':>10}  {'d_model':>7} {'layers':>6} {'heads':>5} {'kv':>3} {'mlp':>6}")
    for r in rows:
        print(f"{r['name']:<16}{r['family']:>8}{_human(r['param_count']):>10}  {cell(r['d_model']):>7} "
              f"{cell(r['num_layers']):>6} {cell(r['num_heads']):>5} {cell(r['num_kv_heads']):>3} {cell(r['mlp_dim']):>6}")
    print("params: counted from the abstract parameter tree (Cosmos 3: both towers, embedding, LM head, "
          "generator I/O; the reasoner's ViT image encoder is not modelled and not counted).")
    write_json(request.json, {"models": rows})
    return 0


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


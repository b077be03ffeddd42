"""`xlaopt passes`: the pass pipeline, in order, with each pass's options."""
from __future__ import annotations

import argparse
import dataclasses


def register(sub) -> None:
    sub.add_parser("passes", help="the pass pipeline, in order")


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.pipeline import pipeline

    for i, p in enumerate(pipeline(), start=1):
        print(f"{i:2d}. {p.name:<24} {p.summary}")
        options = [f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p) if f.name not in ("name", "summary")]
        if options:
            print(f"    {'':<24} options (--pass-option {p.name}.FIELD=VALUE): {', '.join(options)}")
    return 0

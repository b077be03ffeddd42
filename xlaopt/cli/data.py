"""`xlaopt data make|stats`: sample stores on tensorstore."""
from __future__ import annotations

import argparse
import pathlib

from xlaopt.cli.requests import write_json


def register(sub) -> None:
    data = sub.add_parser("data", help="sample stores on tensorstore").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("make", help="write a synthetic Cosmos-like sample store")
    p.add_argument("dir")
    p.add_argument("--model", default="cosmos3-tiny", help="the Cosmos 3 config whose latent widths to use")
    p.add_argument("--mix", default=None, metavar="NAME",
                   help="samples of this named mix of real shapes (cosmos3-480p, cosmos3-mid, cosmos3-720p; "
                        "random latents) instead of the toy-sized synthetic ones")
    p.add_argument("--samples", type=int, default=None,
                   help="default 20,000 toy samples, or the mix's default, small because its latents are large: "
                        "cosmos3-480p 2,000 (~250 MB at cosmos3-tiny widths, ~1.5 GB at cosmos3-nano's), "
                        "cosmos3-mid 200 (~170 MB, ~1 GB), cosmos3-720p 16 (~90 MB, ~540 MB: a 720p clip is "
                        "44,160 x 192 float32 latents at nano's width, 34 MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=64.0, help="approximate shard size")
    p = data.add_parser("stats", help="a store's sample count, shards and length statistics")
    p.add_argument("dir")
    p.add_argument("--json", default=None, metavar="OUT")


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.data.store import SampleStore
    from xlaopt.models.registry import get_config

    if args.data_command == "make":
        config, shard_bytes = get_config(args.model), int(args.shard_mb * 2**20)
        if args.mix is None:
            from xlaopt.data.synthetic_store import DEFAULT_SAMPLES, make_store

            samples = DEFAULT_SAMPLES if args.samples is None else args.samples
            manifest = make_store(args.dir, config, samples, args.seed, shard_bytes)
        else:
            from xlaopt.data.mixes import get_mix, latent_bytes
            from xlaopt.data.synthetic_store import make_mix_store

            mix = get_mix(args.mix)
            samples = mix.default_samples if args.samples is None else args.samples
            if samples >= 1 and config.family == "cosmos3":
                print(f"{args.dir}: writing {samples} samples of {mix.name} at {config.name}'s widths, "
                      f"~{latent_bytes(mix.lengths(samples, args.seed), config) / 1e6:.0f} MB of latents")
            manifest = make_mix_store(args.dir, config, mix, samples, args.seed, shard_bytes)
        size = sum(f.stat().st_size for f in pathlib.Path(args.dir).rglob("*") if f.is_file())
        print(f"{args.dir}: store size {size / 1e6:.1f} MB")
    else:
        manifest = SampleStore(args.dir).manifest
        write_json(args.json, manifest)
    stats = manifest["stats"]
    print(f"{args.dir}: {manifest['num_samples']} samples in {len(manifest['shards'])} shards; "
          + ", ".join(f"{k} {v}" for k, v in stats["modalities"].items()))
    for key in ("text_tokens", "gen_tokens", "tokens"):
        q = stats[key]
        print(f"  {key:<12} mean {q['mean']:.1f}  p50 {q['p50']:.0f}  p90 {q['p90']:.0f}  p99 {q['p99']:.0f}  max {q['max']}")
    return 0

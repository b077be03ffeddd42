"""`xlaopt data make|stats`: sample stores on tensorstore."""
from __future__ import annotations

import argparse
import dataclasses
import pathlib

from xlaopt.cli.requests import request_of, write_json


@dataclasses.dataclass(frozen=True)
class MakeRequest:
    dir: str
    model: str
    mix: str | None
    samples: int | None  # None: the toy default, or the mix's
    seed: int
    shard_mb: float


@dataclasses.dataclass(frozen=True)
class StatsRequest:
    dir: str
    json: str | None


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
    if args.data_command == "make":
        return make(request_of(MakeRequest, args))
    return stats(request_of(StatsRequest, args))


def make(request: MakeRequest) -> int:
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    from xlaopt.models.registry import get_config

    config, shard_bytes = get_config(request.model), int(request.shard_mb * 2**20)
    if request.mix is None:
        from xlaopt.data.synthetic_store import DEFAULT_SAMPLES, make_store

        samples = DEFAULT_SAMPLES if request.samples is None else request.samples
        manifest = make_store(request.dir, config, samples, request.seed, shard_bytes)
    else:
        from xlaopt.data.mixes import get_mix, latent_bytes
        from xlaopt.data.synthetic_store import make_mix_store
        from xlaopt.families import family_of

        mix = get_mix(request.mix)
        samples = mix.default_samples if request.samples is None else request.samples
        if samples >= 1 and family_of(config).packs_samples:
            print(f"{request.dir}: writing {samples} samples of {mix.name} at {config.name}'s widths, "
                  f"~{latent_bytes(mix.lengths(samples, request.seed), config) / 1e6:.0f} MB of latents")
        manifest = make_mix_store(request.dir, config, mix, samples, request.seed, shard_bytes)
    size = sum(f.stat().st_size for f in pathlib.Path(request.dir).rglob("*") if f.is_file())
    print(f"{request.dir}: store size {size / 1e6:.1f} MB")
    _print_manifest(request.dir, manifest)
    return 0


def stats(request: StatsRequest) -> int:
    from xlaopt.data.store import SampleStore

    manifest = SampleStore(request.dir).manifest
    write_json(request.json, manifest)
    _print_manifest(request.dir, manifest)
    return 0


def _print_manifest(directory: str, manifest: dict) -> None:
    stats = manifest["stats"]
    print(f"{directory}: {manifest['num_samples']} samples in {len(manifest['shards'])} shards; "
          + ", ".join(f"{k} {v}" for k, v in stats["modalities"].items()))
    for key in ("text_tokens", "gen_tokens", "tokens"):
        q = stats[key]
        print(f"  {key:<12} mean {q['mean']:.1f}  p50 {q['p50']:.0f}  p90 {q['p90']:.0f}  p99 {q['p99']:.0f}  max {q['max']}")

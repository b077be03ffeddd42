"""Synthetic Cosmos-like sample stores: written on request (`xlaopt data make`) or, as the
default data of `xlaopt train` (and of `train --mix`), once per model shape in a cache
directory on first use. Toy samples (`synthetic_cosmos`) or a named mix of real shapes (`mixes`)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import numpy as np

from xlaopt.data.mixes import Mix, latent_widths
from xlaopt.data.store import VERSION, StoreWriter
from xlaopt.data.synthetic_cosmos import CosmosSamples
from xlaopt.errors import UserError
from xlaopt.models.cosmos3_config import Cosmos3Config

DEFAULT_SAMPLES = 20_000
# The config fields the synthetic samples depend on; other fields (depth, width) share a store.
_DATA_FIELDS = ("vocab_size", "generator_in_dim", "latent_patch_dim", "action_dim", "sound_dim",
                "num_action_domains")


def _check(config: Cosmos3Config, samples: int) -> None:
    from xlaopt.families import family_of

    if not family_of(config).packs_samples:
        raise UserError(f"--model {config.name}: synthetic stores hold Cosmos 3 samples; pick a cosmos3-* model")
    if samples < 1:
        raise UserError(f"--samples {samples}: need at least one sample")


def make_store(directory, config: Cosmos3Config, samples: int = DEFAULT_SAMPLES, seed: int = 0,
               shard_bytes: int = 64 << 20) -> dict:
    """Write `samples` synthetic samples for `config`; returns the manifest."""
    _check(config, samples)
    generator, rng = CosmosSamples(config, seed), np.random.default_rng(seed)
    writer = StoreWriter(directory, generator.widths(), shard_bytes=shard_bytes)
    return writer.add_all(generator.draw(rng) for _ in range(samples)).close()


def make_mix_store(directory, config: Cosmos3Config, mix: Mix, samples: int, seed: int = 0,
                   shard_bytes: int = 64 << 20) -> dict:
    """Write `samples` samples of `mix` at `config`'s latent widths; returns the manifest. The
    store's lengths are `mix.lengths(samples, seed)`."""
    _check(config, samples)
    writer = StoreWriter(directory, latent_widths(config), shard_bytes=shard_bytes)
    return writer.add_all(mix.draw_many(samples, seed, config)).close()


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XLAOPT_CACHE") or pathlib.Path.home() / ".cache" / "xlaopt")


def default_store(config: Cosmos3Config, seed: int = 0, samples: int = DEFAULT_SAMPLES) -> pathlib.Path:
    """The default store for `config`'s data shape, made on first use."""
    return _cached(config.name, {"seed": seed, "samples": samples}, config,
                   lambda tmp: make_store(tmp, config, samples, seed))


def mix_store(config: Cosmos3Config, mix: Mix, seed: int = 0, samples: int | None = None) -> pathlib.Path:
    """A store of `mix` (`mix.default_samples` samples unless `samples`) for `config`'s data
    shape, made on first use. The key holds the mix's whole definition, so a changed mix is a
    new store rather than a stale one."""
    samples = mix.default_samples if samples is None else samples
    return _cached(f"{mix.name}-{config.name}", {"mix": repr(mix), "seed": seed, "samples": samples}, config,
                   lambda tmp: make_mix_store(tmp, config, mix, samples, seed))


def _cached(prefix: str, key: dict, config: Cosmos3Config, make) -> pathlib.Path:
    """The cached store of `key` (plus `config`'s data fields), made by `make(directory)` under a
    temporary name and renamed, so a crash or a concurrent run never sees half a store."""
    text = json.dumps({f: getattr(config, f) for f in _DATA_FIELDS} | key | {"format": VERSION}, sort_keys=True)
    name = f"{prefix}-{hashlib.sha1(text.encode()).hexdigest()[:10]}"
    path = cache_root() / "stores" / name
    if (path / "manifest.json").exists():
        return path
    tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    make(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another run made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path

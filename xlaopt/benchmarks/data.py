"""`xlaopt bench data`: the xlaopt loader and Grain feeding the same cosmos3-tiny training step
from the same sample store, with the same packing budget, interleaved round by round (who goes
first alternates), medians reported.

Per contender and round: `steps` training steps (after one untimed warm-up step) of the
compiled program `xlaopt train` runs (pass pipeline applied, simulated CPU mesh), from a fresh
state and a cold page cache. Reported:

- `tokens_per_s`: real (non-padding) tokens over the timed steps' wall time;
- `padding_fraction`: padding tokens over the budget of every step;
- `p99_next_s`: 99th percentile of the time `next()` blocks in the loop;
- `data_wait_fraction`: Grain's idle ratio, (train_time - steps * step_latency) / train_time,
  with step_latency the median time of the same step fed one fixed batch (measured each round);
  clipped at 0.

Plus, without training: each loader alone (`alone`: `read_batches` batches as fast as it
delivers them, cold page cache; real tokens/s, payload MB/s, padding), `disk_read_cold_MBps` (a
sequential cold read of a scratch file on the store's file system) and the xlaopt loader's read
bandwidth from a warm page cache (payload bytes: text and latents as stored). Unless the warm pass is at
least twice as fast as the cold one, the loader is bound by its CPU work, not by the disk, and
the result says so (`loader_io_bound`).

Grain's side is Grain's own machinery: a `MapDataset` over the store (random access through
tensorstore, a seeded global shuffle), `to_iter_dataset` with its threaded read-ahead
(`ReadOptions`), `grain.experimental.BestFitPackIterDataset` packing the per-token features of
each sample into `batch_size` bins of the same (text, generator) budget, `batch`, and
`ThreadPrefetchIterDataset` so packing runs off the training thread. Grain's packer does produce
every per-token field itself: each sample is mapped to its per-token arrays (tokens, mRoPE
positions, modality, noise mask, sigma, latents; `xlaopt.data.packing.sample_arrays`, the
code the xlaopt row builder uses) and Grain packs them and assigns the segment ids; the batch
function only renames, transposes the mRoPE axis and gives padding the positions the model
expects, so both contenders feed the step identical arrays for identical rows (a test checks
this against the row builder).

Command (about 5 minutes on 2 cores with the defaults; `--steps 8` about 2.5, a minute of it
compiling):

    xlaopt bench data --json bench-data.json

Expected on the 2-core dev box (a ~1 s step): xlaopt pads ~0.2-1% against ~20% for Grain's
online best-fit (which closes a batch at the first sample that fits no bin), both keep the step
fed, so tokens/s differ by about the real tokens per step (~1.25x) plus noise; the loader's read
pass is CPU bound (the toy samples are ~1 KB; ~2 MB/s), nowhere near the disk's cold bandwidth.
"""
from __future__ import annotations

import functools
import pathlib
import shutil
import statistics
import tempfile
import time
from typing import Callable

import numpy as np

from xlaopt.benchmarks.disk import drop_page_cache, probe_read_cold_MBps
from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.loader import RESOLUTION_SHIFT, Loader, split_budget
from xlaopt.data.packing import logit_normal_sigma, sample_arrays
from xlaopt.data.store import SampleStore
from xlaopt.data.synthetic_store import make_store
from xlaopt.errors import UserError

MODEL, MESH, SETTINGS = "cosmos3-tiny", "data=2,fsdp=2,tensor=2", {"num_layers": 2}
CONTENDERS = ("xlaopt", "grain")
_TEXT_FIELDS = ("text_tokens", "text_positions")
_GEN_FIELDS = ("gen_positions", "gen_modality", "gen_action_domain", "gen_noisy", "gen_sigma", "gen_x0")


def grain_missing() -> str | None:
    """Why Grain cannot run here, or None."""
    try:
        import grain  # noqa: F401
        import grain.experimental  # noqa: F401
    except ImportError as e:
        return f"Grain is not installed ({e}); install it with pip install grain (an optional benchmark dependency)"
    return None


# ----------------------------------------------------------------------------- Grain's pipeline

class StoreSource:
    """Grain random-access data source over a sample store: record i is sample i's per-token
    arrays (token axis first, as Grain's packer wants) and its id."""

    def __init__(self, store_dir, config, seed: int = 0):
        self.store, self.config, self.seed = SampleStore(store_dir), config, seed
        # Load every shard index and open the arrays once, before Grain's reader threads start.
        self.lengths = self.store.lengths()
        self.store.read_many(range(min(len(self.store), 256)))

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        # The sigma the xlaopt loader draws for this sample in epoch 0.
        sigma = logit_normal_sigma(np.random.default_rng([self.seed, 0, 1, i]), RESOLUTION_SHIFT)
        a = sample_arrays(self.store.read(i), sigma, self.config)
        for name in ("text_positions", "gen_positions"):
            a[name] = np.ascontiguousarray(a[name].T)  # [n, 3]: Grain packs along the first axis
        a["id"] = i
        return a


def grain_rows_to_batch(rows: list[dict], config, shape: BatchShape) -> tuple[dict[str, np.ndarray], list]:
    """Grain's packed rows -> the arrays `cosmos3_batch_spec` describes, and each row's ids."""
    spec = cosmos3_batch_spec(config, shape)
    stack = lambda name: np.stack([r[name] for r in rows])
    text_seg, gen_seg = stack("text_tokens_segment_ids"), stack("gen_x0_segment_ids")
    # Padding is trailing; its positions count on from 0, as the row builder writes them.
    text_pad = np.where(text_seg == 0, np.cumsum(text_seg == 0, axis=1) - 1, 0)
    gen_pad = np.where(gen_seg == 0, np.cumsum(gen_seg == 0, axis=1) - 1, 0)
    out = {
        "text_tokens_BT": stack("text_tokens"),
        "text_segment_ids_BT": text_seg,
        "text_positions_3BT": np.moveaxis(stack("text_positions"), -1, 0) + text_pad,
        "gen_segment_ids_BV": gen_seg,
        "gen_positions_3BV": np.moveaxis(stack("gen_positions"), -1, 0) + gen_pad,
        "gen_modality_BV": stack("gen_modality"),
        "gen_action_domain_BV": stack("gen_action_domain"),
        "gen_noisy_BV": stack("gen_noisy"),
        "gen_sigma_BV": stack("gen_sigma"),
        "gen_x0_BVC": stack("gen_x0"),
    }
    out = {k: np.ascontiguousarray(out[k], dtype=dtype) for k, (_, dtype, _) in spec.items()}
    for k, (s, _, _) in spec.items():
        if out[k].shape != s:
            raise AssertionError(f"Grain batch {k}: shape {out[k].shape}, the model takes {s}")
    return out, [list(r["id"]) for r in rows]


def grain_dataset(source: StoreSource, shape: BatchShape, seed: int = 0, read_threads: int = 16,
                  read_buffer: int = 500, prefetch: int = 2):
    """Grain's own pipeline: shuffle, threaded reads, best-fit packing, batching, prefetch."""
    import grain
    import grain.experimental as ge

    T, V = shape.text_len, shape.gen_len
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat()
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=read_buffer))
    lengths = {**{k: T for k in _TEXT_FIELDS}, **{k: V for k in _GEN_FIELDS}}
    it = ge.BestFitPackIterDataset(it, length_struct=lengths, num_packing_bins=shape.batch_size, seed=seed,
                                   shuffle_bins=False, meta_features=("id",))
    it = it.batch(shape.batch_size, batch_fn=lambda rows: grain_rows_to_batch(rows, source.config, shape))
    return ge.ThreadPrefetchIterDataset(it, prefetch_buffer_size=prefetch)


class _GrainFeed:
    def __init__(self, source, shape, seed):
        self._it = iter(grain_dataset(source, shape, seed))

    def __next__(self):
        return next(self._it)[0]

    def after_step(self, step_s: float) -> None:
        pass  # Grain sizes its buffers itself

    def close(self):
        self._it.close()


class _XlaoptFeed:
    def __init__(self, store_dir, config, shape, seed, read_ahead: bool = False):
        self.loader = Loader(SampleStore(store_dir), config, shape, seed=seed)
        if read_ahead:  # alone, nothing sizes its window: read ahead fully
            self.loader.prefetch = self.loader.max_prefetch

    def __next__(self):
        return next(self.loader)

    def after_step(self, step_s: float) -> None:
        self.loader.size_window(step_s)  # as `xlaopt train` does

    def close(self):
        self.loader.close()


# ----------------------------------------------------------------------------- measurements

def _real_tokens(batch: dict) -> int:
    return int((batch["text_segment_ids_BT"] > 0).sum() + (batch["gen_segment_ids_BV"] > 0).sum())


def _payload_bytes(batch: dict, widths: dict[int, int]) -> int:
    """Bytes of the stored samples in a batch: int32 text tokens, float32 latents at their width."""
    n = 4 * int((batch["text_segment_ids_BT"] > 0).sum())
    real = batch["gen_segment_ids_BV"] > 0
    for modality, width in widths.items():
        n += 4 * width * int((real & (batch["gen_modality_BV"] == modality)).sum())
    return n


def _step(compiled, state, batch, key):
    state, metrics = compiled.train_step(state, compiled.put_batch(batch), key)
    float(metrics["loss"])  # the loss on the host: the step is done
    return state


def _step_latency(compiled, key, batch, n: int) -> float:
    """Median time of the training step fed one fixed host batch: the step without data."""
    state = _step(compiled, compiled.init(key), batch, key)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state = _step(compiled, state, batch, key)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _train_round(compiled, key, feed, steps: int, step_latency: float, budget: int) -> dict:
    state = _step(compiled, compiled.init(key), next(feed), key)  # warm-up, untimed
    waits, real = [], 0
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(feed)
        waits.append(time.perf_counter() - t0)
        real += _real_tokens(batch)
        t1 = time.perf_counter()
        state = _step(compiled, state, batch, key)
        feed.after_step(time.perf_counter() - t1)
    train_time = time.perf_counter() - t_start
    return {"tokens_per_s": real / train_time, "padding_fraction": 1.0 - real / (steps * budget),
            "p99_next_s": float(np.quantile(waits, 0.99)),
            "data_wait_fraction": max(0.0, (train_time - steps * step_latency) / train_time),
            "next_wait_fraction": sum(waits) / train_time,  # the time next() blocked, measured directly
            "real_tokens": real, "budget_tokens": steps * budget, "train_time_s": train_time}


def _loader_alone(feed, batches: int, budget: int, widths) -> dict:
    """A loader with no training: `batches` batches read and packed as fast as it delivers them."""
    t0, nbytes, real = time.perf_counter(), 0, 0
    for _ in range(batches):
        batch = next(feed)
        nbytes += _payload_bytes(batch, widths)
        real += _real_tokens(batch)
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": real / elapsed, "MBps": nbytes / elapsed / 1e6,
            "padding_fraction": 1.0 - real / (batches * budget)}


def _compiled_program(shape: BatchShape, model: str, mesh: str, settings: dict, seed: int):
    from xlaopt.compile import compile_program
    from xlaopt.mesh import MeshSpec, make_mesh, request_cpu_devices
    from xlaopt.models.registry import get_config
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.program import TrainProgram, TrainSettings

    spec = MeshSpec.parse(mesh)
    request_cpu_devices(spec.num_devices)
    make_mesh(spec)
    program = TrainProgram(get_config(model, settings), spec,
                           settings=TrainSettings(batch=shape, seed=seed))
    program, _ = run_pipeline(program, pipeline(), None)
    compiled = compile_program(program)
    compiled.train_step  # noqa: B018 (compile now, outside every timed region)
    return program, compiled


def run(store_dir: str | None = None, steps: int = 30, repeats: int = 3, progress: Callable = print,
        samples: int = 20_000, read_batches: int = 200, model: str = MODEL, mesh: str = MESH,
        settings: dict | None = None, batch_size: int | None = None, row_tokens: int | None = None,
        seed: int = 0, disk_probe_mb: int = 256, row: tuple[int, int] | None = None) -> dict:
    """Both contenders on one store (a synthetic one of `samples` in a temp dir when none is
    given), `repeats` interleaved rounds of `steps` timed training steps each; medians.

    The row budget is `row` (text, generator) when given (a mix's), else `xlaopt train --data`'s:
    the family's row length (or `row_tokens`) split in the ratio of the store's mean text and
    generator lengths."""
    missing = grain_missing()
    if missing:
        raise UserError(f"bench data compares against Grain: {missing}")
    if steps < 2 or repeats < 1:
        raise UserError(f"bench data: need steps >= 2 and repeats >= 1 (got {steps}, {repeats})")
    from xlaopt.models.registry import get_config

    settings = SETTINGS if settings is None else settings
    scratch = None
    if store_dir is None:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="xlaopt-bench-data-"))
        progress(f"making a synthetic store of {samples} samples in {scratch}")
        store_dir = scratch / "store"
        make_store(store_dir, get_config(model), samples, seed)
    store_dir = pathlib.Path(store_dir)
    try:
        store = SampleStore(store_dir)
        config = get_config(model, settings)
        shape = _batch_shape(store, config, row, row_tokens, batch_size)
        progress(f"compiling {model} ({settings}) on {mesh}, rows of {shape.text_len} text + {shape.gen_len} "
                 f"generator tokens, {shape.batch_size} rows")
        program, compiled = _compiled_program(shape, model, mesh, settings, seed)
        import jax

        key = jax.random.key(seed)
        feed_of = functools.partial(_feed, store_dir=store_dir, config=config, shape=shape,
                                    source=StoreSource(store_dir, config, seed), seed=seed)
        first = _XlaoptFeed(store_dir, config, shape, seed + 1)
        fixed = next(first)  # the one batch the step-latency runs are fed
        first.close()
        rounds = {name: [] for name in CONTENDERS}
        rounds |= {"step_latency_s": [], "disk_read_cold_MBps": [], "loader_read_warm_MBps": []}
        rounds |= {f"{name}_alone": [] for name in CONTENDERS}
        for r in range(repeats):
            latency = _step_latency(compiled, key, fixed, max(3, steps // 4))
            rounds["step_latency_s"].append(latency)
            order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
            cache = _train_contenders(rounds, order, feed_of, store_dir, compiled, key, steps, latency, shape.tokens)
            rounds["disk_read_cold_MBps"].append(probe_read_cold_MBps(store_dir, disk_probe_mb << 20))
            _loaders_alone(rounds, order, feed_of, store_dir, read_batches, shape.tokens, store.widths)
            progress(_round_line(rounds, r, repeats, latency))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    head = {"model": model, "settings": settings, "mesh": mesh, "store": str(store_dir) if scratch is None else None,
            "samples": len(store), "batch": {"batch_size": shape.batch_size, "text_len": shape.text_len,
                                             "gen_len": shape.gen_len},
            "tokens_per_step_budget": shape.tokens, "steps": steps, "repeats": repeats, "page_cache": cache}
    return _result(head, rounds, read_batches)


def _batch_shape(store: SampleStore, config, row: tuple[int, int] | None, row_tokens: int | None,
                 batch_size: int | None) -> BatchShape:
    """The batch both contenders fill: `row` (text, generator) when given, else the family's row
    length (or `row_tokens`) split in the ratio of the store's mean text and generator lengths."""
    from xlaopt.families import family_of

    default = family_of(config).default_batch(config)
    stats = store.manifest["stats"]
    text, gen = row or split_budget(row_tokens or default.text_len + default.gen_len,
                                    stats["text_tokens"]["mean"], stats["gen_tokens"]["mean"])
    return BatchShape(batch_size or default.batch_size, text, gen)


def _feed(name: str, *, store_dir, config, shape: BatchShape, source: StoreSource, seed: int,
          read_ahead: bool = False):
    """A fresh feed of contender `name` over the store."""
    if name == "xlaopt":
        return _XlaoptFeed(store_dir, config, shape, seed, read_ahead=read_ahead)
    return _GrainFeed(source, shape, seed)


def _train_contenders(rounds: dict, order, feed_of: Callable, store_dir, compiled, key, steps: int,
                      latency: float, budget: int) -> str:
    """One round's training measurement: each contender in `order`, from a cold page cache,
    `steps` timed steps appended to `rounds[name]`. Returns how the page cache was dropped."""
    cache = ""
    for name in order:
        cache = drop_page_cache([store_dir])
        feed = feed_of(name)
        try:
            rounds[name].append(_train_round(compiled, key, feed, steps, latency, budget))
        finally:
            feed.close()
    return cache


def _loaders_alone(rounds: dict, order, feed_of: Callable, store_dir, read_batches: int, budget: int,
                   widths) -> None:
    """One round's measurement without training: each loader alone from a cold page cache
    (`rounds[name + "_alone"]`), and the xlaopt loader again over the same samples, now in the
    page cache (`rounds["loader_read_warm_MBps"]`)."""
    for name in order:
        drop_page_cache([store_dir])
        feed = feed_of(name, read_ahead=True)
        try:
            rounds[f"{name}_alone"].append(_loader_alone(feed, read_batches, budget, widths))
            if name == "xlaopt":  # the same samples again, now in the page cache
                feed.close()
                feed = feed_of(name, read_ahead=True)
                rounds["loader_read_warm_MBps"].append(_loader_alone(feed, read_batches, budget, widths)["MBps"])
        finally:
            feed.close()


def _result(head: dict, rounds: dict, read_batches: int) -> dict:
    """The result: `head` (what ran, on what), the medians over the rounds, every round's figures."""
    med = statistics.median
    result = head | {"step_latency_s": med(rounds["step_latency_s"]),
                     "disk_read_cold_MBps": med(rounds["disk_read_cold_MBps"]),
                     "loader_read_cold_MBps": med(r["MBps"] for r in rounds["xlaopt_alone"]),
                     "loader_read_warm_MBps": med(rounds["loader_read_warm_MBps"]),
                     "read_batches": read_batches, "rounds": rounds}
    return _with_medians(result, rounds)


def _round_line(rounds: dict, r: int, repeats: int, latency: float) -> str:
    """One round's figures, as the progress line."""
    return (f"round {r + 1}/{repeats}: step {latency * 1e3:.0f} ms; "
            + "; ".join(f"{n} {rounds[n][-1]['tokens_per_s']:.0f} tok/s, pad "
                        f"{100 * rounds[n][-1]['padding_fraction']:.1f}%, wait "
                        f"{100 * rounds[n][-1]['data_wait_fraction']:.1f}%" for n in CONTENDERS)
            + f"; disk cold {rounds['disk_read_cold_MBps'][-1]:.0f} MB/s, loader read "
              f"{rounds['xlaopt_alone'][-1]['MBps']:.1f} MB/s cold / "
              f"{rounds['loader_read_warm_MBps'][-1]:.1f} MB/s warm; alone "
              + ", ".join(f"{n} {rounds[n + '_alone'][-1]['tokens_per_s']:.0f} tok/s" for n in CONTENDERS))


def _with_medians(result: dict, rounds: dict) -> dict:
    """`result` with each contender's medians over the rounds, and the ratios the report leads with."""
    med = statistics.median
    for name in CONTENDERS:
        result[name] = {k: med(r[k] for r in rounds[name]) for k in rounds[name][0]}
        alone = rounds[f"{name}_alone"]
        result[name]["alone"] = {k: med(r[k] for r in alone) for k in alone[0]}
    # I/O bound: a warm page cache at least doubles the rate (the disk, not the CPU, sets the pace).
    result["loader_io_bound"] = result["loader_read_warm_MBps"] >= 2 * result["loader_read_cold_MBps"]
    result["ratios"] = {
        "tokens_per_s_xlaopt_vs_grain": result["xlaopt"]["tokens_per_s"] / result["grain"]["tokens_per_s"],
        "loader_alone_tokens_per_s_xlaopt_vs_grain": (result["xlaopt"]["alone"]["tokens_per_s"]
                                                       / result["grain"]["alone"]["tokens_per_s"]),
        "loader_read_cold_vs_disk": result["loader_read_cold_MBps"] / result["disk_read_cold_MBps"]}
    return result


def format_table(result: dict) -> str:
    b = result["batch"]
    lines = [f"data bench: {result['model']} {result['settings']} on {result['mesh']}, {result['samples']} samples, "
             f"{b['batch_size']} rows of {b['text_len']} text + {b['gen_len']} generator tokens; "
             f"{result['steps']} steps, medians of {result['repeats']} interleaved rounds; "
             f"step alone {result['step_latency_s'] * 1e3:.0f} ms",
             f"{'':8}{'tokens/s':>10}{'padding':>9}{'p99 next s':>12}{'data wait':>11}"]
    for name in CONTENDERS:
        r = result[name]
        lines.append(f"{name:8}{r['tokens_per_s']:>10.0f}{100 * r['padding_fraction']:>8.1f}%"
                     f"{r['p99_next_s']:>12.4f}{100 * r['data_wait_fraction']:>10.1f}%")
    lines.append("loaders alone (no training, cold page cache): " + ", ".join(
        f"{n} {result[n]['alone']['tokens_per_s']:.0f} tokens/s ({100 * result[n]['alone']['padding_fraction']:.1f}% "
        f"padding)" for n in CONTENDERS))
    lines.append(f"disk cold read {result['disk_read_cold_MBps']:.0f} MB/s ({result['page_cache']}); loader read pass "
                 f"({result['read_batches']} batches, no training) {result['loader_read_cold_MBps']:.1f} MB/s cold, "
                 f"{result['loader_read_warm_MBps']:.1f} MB/s warm: "
                 + ("I/O bound" if result["loader_io_bound"] else "CPU bound, not I/O bound"))
    lines.append("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))
    return "\n".join(lines)

"""`xlaopt bench data --io`: the loader against the disk, on real-size samples.

`xlaopt bench data` runs on toy ~1 KB samples, where per-sample Python work, not the disk,
bounds the loader. Here the store holds Cosmos-size video latents (`xlaopt.data.synthetic_video`:
720p clips of up to ~43k tokens x 192 float32 channels, ~8-33 MB each; ~2.4 GB by default),
so the loader is I/O bound unless its CPU cost per byte is too high.

Per round, each from a cold page cache (dropped before every pass), in an order that alternates
between rounds:

- `disk_read_cold_MBps`: what `xlaopt bench data` reports under that name, a fresh 256 MiB
  probe file on the store's file system written, synced, and read sequentially with 16 MiB
  reads; the goal's yardstick;
- `disk_read_cold_store_files_MBps`: the store's own files read the same way;
- `disk_read_cold_parallel_MBps`: the store's files as `threads` concurrent O_DIRECT reads of
  `piece_mb`, no checksum, no copy: what the disk gives a reader that does no work;
- `loader_read_cold_MBps` (the headline) and `loader_tensorstore_read_cold_MBps`: the whole
  `Loader` (plan, read, pack on its threads) delivering packed batches to a consumer that only
  counts them, payload bytes (text and latents as stored) per second, with its default shard
  reader and with tensorstore reads (`direct=False`). Measured in steady state: the first
  `warmup` batches pay one-time costs (opening shard files, starting threads, faulting in the
  first batch buffers; `loader_start_s` is the first batch's latency), which training hides
  behind compilation, and are not counted; the window then runs from the delivery of batch
  `warmup` to that of the last, with the same number of batches' reads in flight at both
  ends. `loader_read_cold_with_start_MBps` counts from the Loader's construction instead;
- `read_many_cold_MBps`, `read_many_tensorstore_cold_MBps`: the read path alone,
  `SampleStore.read_many` called per batch, one batch at a time (nothing read ahead).

The pass covers the loader's planned batches up to the last one before any sample would be
read a second time, so every counted byte comes from the disk.

Reported: medians over rounds, every round's figures, the process's CPU use during each pass
(cores busy: well under the host's core count means the pass waited on the disk), the
host's load average around each round (other work shares the cores and the disk), each
round's ratios to the disk and their medians, sizes, and where the shard reader's time went
(`ShardReader.stats`: seconds in reads, checksums and copies, summed over threads).

Command (about 2 minutes with the defaults, a fresh store made and removed):

    xlaopt bench data --io [--repeats R] [--store DIR] [--dir SCRATCH] [--json OUT]

Measured figures are in BENCHMARKS.md. Buffered sequential reads on the dev VM swing between
0.4 and 2.5 GB/s from round to round with the host's other work, hence the per-round ratios.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import statistics
import tempfile
import threading
import time
from typing import Callable

import numpy as np

from xlaopt.benchmarks.disk import drop_page_cache, probe_read_cold_MBps, read_files_cold_MBps
from xlaopt.data.batch import BatchShape
from xlaopt.data.loader import BatchPacker, Loader, LoaderState
from xlaopt.data.shard_reader import PIECE_BYTES, THREADS, ShardReader
from xlaopt.data.store import SampleStore
from xlaopt.data.synthetic_video import DEFAULT_CONFIG, DEFAULT_SAMPLES, TOKENS_720P, make_video_store
from xlaopt.errors import UserError
from xlaopt.io.hostmem import aligned_empty

PASSES = ("disk_probe", "disk_files", "disk_parallel", "loader", "loader_tensorstore", "read_many",
          "read_many_tensorstore")
WARMUP_BATCHES = 3


def store_files(store_dir: pathlib.Path) -> list[pathlib.Path]:
    """The store's data files (zarr.json and the manifest aside), in name order."""
    return sorted(p for p in store_dir.rglob("*") if p.is_file() and p.name not in ("zarr.json", "manifest.json"))


def files_read_cold_parallel_MBps(files: list[pathlib.Path], threads: int = THREADS,
                                  piece_bytes: int = PIECE_BYTES) -> float:
    """The files as `threads` concurrent O_DIRECT reads of `piece_bytes` into reused aligned
    buffers: the disk's bandwidth to a reader with this queue depth that does no work."""
    drop_page_cache(files)
    local = threading.local()
    fds = {}
    try:
        for path in files:
            try:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                fds[path] = os.open(path, os.O_RDONLY)
        jobs = [(path, off) for path in files for off in range(0, path.stat().st_size, piece_bytes)]

        def read(job) -> int:
            if getattr(local, "buf", None) is None:
                local.buf = aligned_empty((piece_bytes,), np.uint8)
            return os.preadv(fds[job[0]], [local.buf], job[1])

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            n = sum(pool.map(read, jobs))
        return n / (time.perf_counter() - t0) / 1e6
    finally:
        for fd in fds.values():
            os.close(fd)


def planned_batches(store: SampleStore, shape: BatchShape, seed: int = 0) -> list[list[int]]:
    """The sample ids of the loader's batches (its planner, its row order, one process), from
    the first batch up to the last one before any sample would be read a second time."""
    planner = BatchPacker(store.lengths(), shape, seed)
    state, seen, batches = LoaderState(), set(), []
    while True:
        rows, state = planner.plan(state)
        ids = [i for row in rows for i in row]
        if seen.intersection(ids) or not ids:
            break
        seen.update(ids)
        batches.append(ids)
    if not batches:
        raise UserError(f"store {store.dir}: the loader plans no sample into a batch of {shape}")
    return batches


def tensorstore_store(store_dir) -> SampleStore:
    """A SampleStore reading through tensorstore (the default reads the shard files itself)."""
    return SampleStore(store_dir, direct=False)


def _payload(samples) -> int:
    return sum(s.text.nbytes + (0 if s.latents is None else s.latents.nbytes) for s in samples)


def read_pass(store: SampleStore, batches: list[list[int]]) -> dict:
    """`store.read_many` per batch, cold: payload MB/s and the cores the process kept busy."""
    store.lengths()  # shard indexes loaded before the clock starts, as a Loader does at construction
    drop_page_cache([store.dir])
    c0, t0, n = os.times(), time.perf_counter(), 0
    for ids in batches:
        n += _payload(store.read_many(ids))
    wall, c1 = time.perf_counter() - t0, os.times()
    return {"MBps": n / wall / 1e6, "bytes": n, "wall_s": wall,
            "cpu_cores": (c1.user - c0.user + c1.system - c0.system) / wall}


def loader_pass(store: SampleStore, config, shape: BatchShape, batches: int, seed: int = 0,
                warmup: int = WARMUP_BATCHES) -> dict:
    """The whole Loader, cold, delivering `batches` packed batches to a consumer that only
    counts their payload (as `bench data` counts it: real text tokens and real generator
    tokens at their width). `MBps`: steady state, batches after the first `warmup`, over the
    time from the delivery of batch `warmup` to that of the last; `with_start_MBps`: all of
    them from the Loader's construction; `start_s`: the first batch's latency."""
    from xlaopt.benchmarks.data import _payload_bytes

    if batches <= warmup:
        raise UserError(f"bench data --io: the pass has {batches} batches, need more than the {warmup} warm-up "
                        f"ones (a larger store: more samples)")
    store.lengths()
    drop_page_cache([store.dir])
    c0, t0 = os.times(), time.perf_counter()
    loader = Loader(store, config, shape, seed=seed)
    try:
        sizes, times = [], []
        for _ in range(batches):
            sizes.append(_payload_bytes(next(loader), store.widths))
            times.append(time.perf_counter())
    finally:
        loader.close()
    c1 = os.times()
    steady = times[-1] - times[warmup - 1]
    return {"MBps": sum(sizes[warmup:]) / steady / 1e6, "with_start_MBps": sum(sizes) / (times[-1] - t0) / 1e6,
            "start_s": times[0] - t0, "bytes": sum(sizes), "wall_s": times[-1] - t0,
            "cpu_cores": (c1.user - c0.user + c1.system - c0.system) / (c1.elapsed - c0.elapsed)}


def _filesystem(path: pathlib.Path) -> str:
    """The device and type of the file system holding `path` (from /proc/mounts)."""
    path, best = path.resolve(), ("?", "?", "")
    try:
        for line in pathlib.Path("/proc/mounts").read_text().splitlines():
            dev, mount, fstype = line.split()[:3]
            if path.is_relative_to(mount) and len(mount) >= len(best[2]):
                best = (dev, fstype, mount)
    except OSError:
        pass
    return f"{best[0]} ({best[1]})"


@dataclasses.dataclass
class _Passes:
    """The passes of a round over one store: its files, the loader's batches, the reader's settings."""
    store_dir: pathlib.Path
    files: list[pathlib.Path]
    config: object
    shape: BatchShape
    batches: list[list[int]]
    threads: int
    piece_bytes: int
    disk_probe_mb: int
    seed: int
    warmup: int

    def shard_store(self) -> tuple[SampleStore, ShardReader]:
        reader = ShardReader(self.threads, self.piece_bytes)
        return SampleStore(self.store_dir, reader=reader), reader

    def measure(self, name: str, rounds: dict) -> int | None:
        """Pass `name` (one of PASSES), its figures appended to `rounds`; the payload bytes the
        shard reader's Loader delivered when that is the pass, else None."""
        if name.startswith("disk"):
            self.disk(name, rounds)
        elif name.startswith("loader"):
            return self.loader(name, rounds)
        else:
            self.read_many(name, rounds)
        return None

    def disk(self, name: str, rounds: dict) -> None:
        if name == "disk_probe":
            rounds["disk_read_cold_MBps"].append(probe_read_cold_MBps(self.store_dir, self.disk_probe_mb << 20))
        elif name == "disk_files":
            rounds["disk_read_cold_store_files_MBps"].append(read_files_cold_MBps(self.files))
        else:
            rounds["disk_read_cold_parallel_MBps"].append(
                files_read_cold_parallel_MBps(self.files, self.threads, self.piece_bytes))

    def loader(self, name: str, rounds: dict) -> int | None:
        plain = name.endswith("tensorstore")
        s, reader = (tensorstore_store(self.store_dir), None) if plain else self.shard_store()
        try:
            p = loader_pass(s, self.config, self.shape, len(self.batches), self.seed, self.warmup)
        finally:
            s.close()
        rounds[f"{name}_read_cold_MBps"].append(p["MBps"])
        rounds[f"{name}_cpu_cores"].append(p["cpu_cores"])
        if plain:
            return None
        rounds["loader_read_cold_with_start_MBps"].append(p["with_start_MBps"])
        rounds["loader_start_s"].append(p["start_s"])
        rounds["reader_stats"].append({k: round(v, 3) if isinstance(v, float) else v
                                       for k, v in reader.stats.items()})
        return p["bytes"]

    def read_many(self, name: str, rounds: dict) -> None:
        plain = name.endswith("tensorstore")
        s = tensorstore_store(self.store_dir) if plain else self.shard_store()[0]
        try:
            p = read_pass(s, self.batches)
        finally:
            s.close()
        rounds[f"{name}_cold_MBps"].append(p["MBps"])
        rounds[f"{name}_cpu_cores"].append(p["cpu_cores"])


ROUND_KEYS = ("disk_read_cold_MBps", "disk_read_cold_store_files_MBps", "disk_read_cold_parallel_MBps",
              "loader_read_cold_MBps", "loader_read_cold_with_start_MBps", "loader_start_s", "loader_cpu_cores",
              "loader_tensorstore_read_cold_MBps", "loader_tensorstore_cpu_cores", "read_many_cold_MBps",
              "read_many_cpu_cores", "read_many_tensorstore_cold_MBps", "read_many_tensorstore_cpu_cores",
              "loadavg_1min", "reader_stats")


def run_io(store_dir: str | os.PathLike | None = None, repeats: int = 3, progress: Callable = print,
           samples: int = DEFAULT_SAMPLES, tokens_per_clip: int = TOKENS_720P, config=None,
           batch_size: int = 2, threads: int = THREADS, piece_mb: float = PIECE_BYTES / (1 << 20),
           scratch_dir: str | os.PathLike | None = None, seed: int = 0, disk_probe_mb: int = 256,
           warmup: int = WARMUP_BATCHES) -> dict:
    """Disk vs the loader on a store of real-size samples (a synthetic video store of `samples`
    clips of up to `tokens_per_clip` tokens in a temp dir under `scratch_dir` when no
    `store_dir` is given), `repeats` rounds, medians. Rows hold two of the longest clips'
    generator tokens and text, `batch_size` rows a batch."""
    if repeats < 1:
        raise UserError(f"bench data --io: need repeats >= 1 (got {repeats})")
    if config is None or isinstance(config, str):
        from xlaopt.models.registry import get_config
        config = get_config(config or DEFAULT_CONFIG)
    piece_bytes = int(piece_mb * (1 << 20))
    scratch = None
    if store_dir is None:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="xlaopt-bench-io-", dir=scratch_dir))
        store_dir = scratch / "store"
        progress(f"making a store of {samples} video clips of up to {tokens_per_clip} tokens in {store_dir}")
        make_video_store(store_dir, samples, tokens_per_clip, config, seed)
    store_dir = pathlib.Path(store_dir)
    try:
        store = SampleStore(store_dir, direct=False)
        stats = store.manifest["stats"]
        shape = BatchShape(batch_size, 2 * stats["text_tokens"]["max"], 2 * stats["gen_tokens"]["max"])
        batches = planned_batches(store, shape, seed)
        files = store_files(store_dir)
        store_bytes = sum(p.stat().st_size for p in files)
        progress(f"{len(store)} samples, {store_bytes / 1e9:.2f} GB in {len(files)} files on "
                 f"{_filesystem(store_dir)}; a pass reads {sum(map(len, batches))} samples in {len(batches)} "
                 f"batches of {batch_size} rows x ({shape.text_len} text + {shape.gen_len} generator tokens)")
        passes = _Passes(store_dir, files, config, shape, batches, threads, piece_bytes, disk_probe_mb, seed, warmup)
        rounds: dict[str, list] = {k: [] for k in ROUND_KEYS}
        cache, payload = "", 0
        for r in range(repeats):
            load_before = os.getloadavg()[0]
            cache = drop_page_cache([store_dir])
            for name in PASSES if r % 2 == 0 else PASSES[::-1]:
                if (delivered := passes.measure(name, rounds)) is not None:
                    payload = delivered
            rounds["loadavg_1min"].append((load_before, os.getloadavg()[0]))
            progress(_io_round_line(rounds, r, repeats, load_before))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"store": None if scratch is not None else str(store_dir), "filesystem": _filesystem(store_dir),
              "samples": len(store), "store_bytes": store_bytes, "files": len(files),
              "mean_sample_MB": store_bytes / len(store) / 1e6,
              "pass_samples": sum(map(len, batches)), "pass_batches": len(batches), "warmup_batches": warmup,
              "pass_payload_bytes": payload,
              "batch": {"batch_size": shape.batch_size, "text_len": shape.text_len, "gen_len": shape.gen_len},
              "threads": threads, "piece_mb": piece_bytes / (1 << 20), "repeats": repeats, "page_cache": cache,
              "cpu_count": os.cpu_count(), "rounds": rounds}
    return _with_io_medians(result, rounds)


def _io_round_line(rounds: dict, r: int, repeats: int, load_before: float) -> str:
    """One round's figures, as the progress line (the load average now, after the round)."""
    return (f"round {r + 1}/{repeats}: disk {rounds['disk_read_cold_MBps'][-1]:.0f} MB/s probe, "
            f"{rounds['disk_read_cold_store_files_MBps'][-1]:.0f} MB/s store files, "
            f"{rounds['disk_read_cold_parallel_MBps'][-1]:.0f} MB/s parallel direct; Loader "
            f"{rounds['loader_read_cold_MBps'][-1]:.0f} MB/s (shard reader), "
            f"{rounds['loader_tensorstore_read_cold_MBps'][-1]:.0f} MB/s (tensorstore); read_many "
            f"{rounds['read_many_cold_MBps'][-1]:.0f} / {rounds['read_many_tensorstore_cold_MBps'][-1]:.0f}"
            f" MB/s; load {load_before:.1f} -> {os.getloadavg()[0]:.1f}")


def _with_io_medians(result: dict, rounds: dict) -> dict:
    """`result` with the medians over the rounds, each round's ratios to the disk (into `rounds`)
    and their medians, and whether the loader meets the 90% goal."""
    med = statistics.median
    for key, values in rounds.items():
        if key.endswith("MBps") or key.endswith("cpu_cores") or key.endswith("_s"):
            result[key] = med(values)
    per_round = lambda num, den: [a / b for a, b in zip(rounds[num], rounds[den])]
    ratios = {"loader_read_vs_disk": per_round("loader_read_cold_MBps", "disk_read_cold_MBps"),
              "loader_read_with_start_vs_disk": per_round("loader_read_cold_with_start_MBps", "disk_read_cold_MBps"),
              "loader_read_vs_disk_store_files": per_round("loader_read_cold_MBps", "disk_read_cold_store_files_MBps"),
              "loader_read_vs_disk_parallel": per_round("loader_read_cold_MBps", "disk_read_cold_parallel_MBps"),
              "loader_tensorstore_read_vs_disk": per_round("loader_tensorstore_read_cold_MBps", "disk_read_cold_MBps"),
              "read_many_vs_disk": per_round("read_many_cold_MBps", "disk_read_cold_MBps"),
              "read_many_tensorstore_vs_disk": per_round("read_many_tensorstore_cold_MBps", "disk_read_cold_MBps")}
    rounds |= {f"ratio_{k}": v for k, v in ratios.items()}
    # Each round's ratio, then the median: the disk's rate drifts with other work between rounds.
    result["ratios"] = {k: med(v) for k, v in ratios.items()}
    result["meets_90_percent"] = result["ratios"]["loader_read_vs_disk"] >= 0.9
    return result


def format_io_table(result: dict) -> str:
    b, r = result["batch"], result["ratios"]
    disk = result["disk_read_cold_MBps"]

    def line(label, mbps, ratio=None, cores=None):
        return (f"{label:48}{mbps:>8.0f}{(mbps / disk if ratio is None else ratio):>9.2f}"
                + ("" if cores is None else f"{cores:>7.2f}"))

    lines = [
        f"data I/O bench: {result['samples']} samples, {result['store_bytes'] / 1e9:.2f} GB "
        f"({result['mean_sample_MB']:.1f} MB a sample) on {result['filesystem']}; a pass reads "
        f"{result['pass_samples']} samples ({result['pass_payload_bytes'] / 1e9:.2f} GB) in {result['pass_batches']} "
        f"batches of {b['batch_size']} x ({b['text_len']} + {b['gen_len']}) tokens; medians of {result['repeats']} "
        f"rounds, cold ({result['page_cache']}); {result['threads']} threads x {result['piece_mb']:g} MiB reads",
        f"{'':48}{'MB/s':>8}{'vs disk':>9}{'cores':>7}",
        f"{'disk: fresh probe file, 16 MiB reads':48}{disk:>8.0f}",
        line("disk: the store files, 16 MiB reads", result["disk_read_cold_store_files_MBps"]),
        line("disk: the store files, parallel O_DIRECT", result["disk_read_cold_parallel_MBps"]),
        line("Loader batches, steady: shard reader", result["loader_read_cold_MBps"], r["loader_read_vs_disk"],
             result["loader_cpu_cores"]),
        line("Loader batches, steady: tensorstore", result["loader_tensorstore_read_cold_MBps"],
             r["loader_tensorstore_read_vs_disk"], result["loader_tensorstore_cpu_cores"]),
        line(f"Loader batches from start ({result['loader_start_s']:.2f} s to the first)",
             result["loader_read_cold_with_start_MBps"], r["loader_read_with_start_vs_disk"]),
        line("read path alone, batch by batch: shard reader", result["read_many_cold_MBps"], r["read_many_vs_disk"],
             result["read_many_cpu_cores"]),
        line("read path alone, batch by batch: tensorstore", result["read_many_tensorstore_cold_MBps"],
             r["read_many_tensorstore_vs_disk"], result["read_many_tensorstore_cpu_cores"]),
    ]
    loads = ", ".join(f"{a:.1f}->{z:.1f}" for a, z in result["rounds"]["loadavg_1min"])
    lines.append(f"Loader (steady, first {result['warmup_batches']} batches not counted) / disk cold read: "
                 f"{r['loader_read_vs_disk']:.2f} (rounds: "
                 + ", ".join(f"{x:.2f}" for x in result["rounds"]["ratio_loader_read_vs_disk"])
                 + f"), {'meets' if result['meets_90_percent'] else 'misses'} the 90% goal; vs the store files read "
                 f"sequentially {r['loader_read_vs_disk_store_files']:.2f}, in parallel "
                 f"{r['loader_read_vs_disk_parallel']:.2f}; "
                 f"load average per round {loads} on {result['cpu_count']} cores")
    return "\n".join(lines)

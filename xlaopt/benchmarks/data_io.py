"""`xlaopt bench data --io`: the loader's read path against the disk, on real-size samples.

`xlaopt bench data` runs on toy ~1 KB samples, where per-sample Python work, not the disk,
bounds the loader. Here the store holds Cosmos-size video latents (`xlaopt.data.synthetic_video`:
720p clips of up to ~43k tokens x 192 float32 channels, ~8-33 MB each; ~1.6 GB by default),
so reading is I/O bound unless the read path's CPU cost per byte is too high.

Per round, each from a cold page cache (dropped before every pass), in an order that alternates
between rounds:

- `disk_read_cold_MBps`: what `xlaopt bench data` reports under that name, a fresh 256 MiB
  probe file on the store's file system written, synced, and read sequentially with 16 MiB
  reads; the goal's yardstick;
- `disk_read_cold_store_files_MBps`: the store's own files read the same way;
- `disk_read_cold_parallel_MBps`: the store's files as `threads` concurrent O_DIRECT reads of
  `piece_mb`, no checksum, no copy: what the disk gives a reader that does no work, the
  ceiling for any read path;
- `loader_read_cold_MBps` (the headline), `tensorstore_read_cold_MBps`: payload bytes (text
  and latents as stored) per second of `read_many` over the loader's planned order, one call
  per batch with that batch's sample ids, the call the loader makes, through
  `SampleStore` (its default shard-file reader, `xlaopt.data.shard_reader`) and with
  `direct=False` (tensorstore). The pass stops before any sample would be read a second time,
  so every byte comes from the disk. This is the loader's read path alone: packing a batch is
  CPU work, not I/O, and is measured next;
- `loader_batches_direct_cold_MBps` / `loader_batches_tensorstore_cold_MBps` (unless
  `loader_batches=False`): the whole `Loader` (plan, read, pack on its background thread)
  delivering the same batches, payload bytes per second: what training gets today.

Reported: medians over rounds, every round's figures, the process's CPU use during each read
pass (cores busy: well under the host's core count means the pass waited on the disk), the
host's load average around each round (other work shares the cores and the disk), each
round's ratios of the read paths to the disk and their medians, sizes, and where the reader's
time went (`ShardReader.stats`: seconds in reads, checksums and copies, summed over threads).

Command (about 2 minutes with the defaults, a fresh store made and removed):

    xlaopt bench data --io [--repeats R] [--store DIR] [--dir SCRATCH] [--json OUT]

Seen on the 2-core dev VM (virtio disk, ext4), 5 rounds, other work keeping the load average
at 1-4: probe 1.6 GB/s, the store files sequentially 0.6 GB/s, in parallel 2.0 GB/s; the
shard reader 1.05 GB/s (0.79 of the probe, 0.63 of the parallel ceiling, 0.6 cores busy),
tensorstore 0.57 GB/s (1.0 core); whole Loader batches 0.62 / 0.43 GB/s. Sequential buffered
reads swing between 0.4 and 2 GB/s from round to round with the host's other work, hence the
per-round ratios.
"""
from __future__ import annotations

import concurrent.futures
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
from xlaopt.checkpoint.hostmem import aligned_empty
from xlaopt.data.batch import BatchShape
from xlaopt.data.loader import Loader, LoaderState, Planner
from xlaopt.data.shard_reader import PIECE_BYTES, THREADS, ShardReader
from xlaopt.data.store import SampleStore
from xlaopt.data.synthetic_video import DEFAULT_CONFIG, DEFAULT_SAMPLES, TOKENS_720P, make_video_store
from xlaopt.errors import UserError

PASSES = ("disk_probe", "disk_files", "disk_parallel", "direct", "tensorstore")


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
    planner = Planner(store.lengths(), shape, seed)
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


def loader_pass(store: SampleStore, config, shape: BatchShape, batches: int, seed: int = 0) -> float:
    """The whole Loader, cold: payload MB/s of `batches` packed batches (as `bench data`'s
    read pass counts them: real text tokens and real generator tokens at their width)."""
    from xlaopt.benchmarks.data import _payload_bytes

    store.lengths()
    drop_page_cache([store.dir])
    t0 = time.perf_counter()
    loader = Loader(store, config, shape, seed=seed)
    loader.prefetch = loader.max_prefetch  # nothing to wait for: read ahead fully
    try:
        n = sum(_payload_bytes(next(loader), store.widths) for _ in range(batches))
        return n / (time.perf_counter() - t0) / 1e6
    finally:
        loader.close()


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


def run_io(store_dir: str | os.PathLike | None = None, repeats: int = 3, progress: Callable = print,
           samples: int = DEFAULT_SAMPLES, tokens_per_clip: int = TOKENS_720P, config=None,
           batch_size: int = 2, threads: int = THREADS, piece_mb: float = PIECE_BYTES / (1 << 20),
           loader_batches: bool = True, scratch_dir: str | os.PathLike | None = None, seed: int = 0,
           disk_probe_mb: int = 256) -> dict:
    """Disk vs the loader's read paths on a store of real-size samples (a synthetic video store
    of `samples` clips of up to `tokens_per_clip` tokens in a temp dir under `scratch_dir` when
    no `store_dir` is given), `repeats` rounds, medians. Rows hold two of the longest clips'
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
        store = SampleStore(store_dir)
        stats = store.manifest["stats"]
        shape = BatchShape(batch_size, 2 * stats["text_tokens"]["max"], 2 * stats["gen_tokens"]["max"])
        batches = planned_batches(store, shape, seed)
        files = store_files(store_dir)
        store_bytes = sum(p.stat().st_size for p in files)
        progress(f"{len(store)} samples, {store_bytes / 1e9:.2f} GB in {len(files)} files on "
                 f"{_filesystem(store_dir)}; a pass reads {sum(map(len, batches))} samples in {len(batches)} "
                 f"batches of {batch_size} rows x ({shape.text_len} text + {shape.gen_len} generator tokens)")
        rounds: dict[str, list] = {k: [] for k in (
            "disk_read_cold_MBps", "disk_read_cold_store_files_MBps", "disk_read_cold_parallel_MBps",
            "loader_read_cold_MBps",
            "tensorstore_read_cold_MBps", "loader_read_cpu_cores", "tensorstore_read_cpu_cores",
            "loadavg_1min", "reader_stats")}
        if loader_batches:
            rounds |= {"loader_batches_direct_cold_MBps": [], "loader_batches_tensorstore_cold_MBps": []}
        cache, payload = "", 0
        for r in range(repeats):
            load_before = os.getloadavg()[0]
            cache = drop_page_cache([store_dir])
            order = PASSES if r % 2 == 0 else PASSES[::-1]
            for name in order:
                if name == "disk_probe":
                    rounds["disk_read_cold_MBps"].append(probe_read_cold_MBps(store_dir, disk_probe_mb << 20))
                elif name == "disk_files":
                    rounds["disk_read_cold_store_files_MBps"].append(read_files_cold_MBps(files))
                elif name == "disk_parallel":
                    rounds["disk_read_cold_parallel_MBps"].append(
                        files_read_cold_parallel_MBps(files, threads, piece_bytes))
                elif name == "direct":
                    reader = ShardReader(threads, piece_bytes)
                    direct = SampleStore(store_dir, reader=reader)
                    try:
                        p = read_pass(direct, batches)
                    finally:
                        direct.close()
                    payload = p["bytes"]
                    rounds["loader_read_cold_MBps"].append(p["MBps"])
                    rounds["loader_read_cpu_cores"].append(p["cpu_cores"])
                    rounds["reader_stats"].append({k: round(v, 3) if isinstance(v, float) else v
                                                   for k, v in reader.stats.items()})
                else:
                    p = read_pass(tensorstore_store(store_dir), batches)
                    rounds["tensorstore_read_cold_MBps"].append(p["MBps"])
                    rounds["tensorstore_read_cpu_cores"].append(p["cpu_cores"])
            if loader_batches:
                for kind in ("direct", "tensorstore") if r % 2 == 0 else ("tensorstore", "direct"):
                    s = SampleStore(store_dir, reader=ShardReader(threads, piece_bytes)) if kind == "direct" \
                        else tensorstore_store(store_dir)
                    try:
                        rounds[f"loader_batches_{kind}_cold_MBps"].append(
                            loader_pass(s, config, shape, len(batches), seed))
                    finally:
                        if kind == "direct":
                            s.close()
            rounds["loadavg_1min"].append((load_before, os.getloadavg()[0]))
            progress(f"round {r + 1}/{repeats}: disk {rounds['disk_read_cold_MBps'][-1]:.0f} MB/s probe, "
                     f"{rounds['disk_read_cold_store_files_MBps'][-1]:.0f} MB/s store files, "
                     f"{rounds['disk_read_cold_parallel_MBps'][-1]:.0f} MB/s parallel direct; loader read "
                     f"{rounds['loader_read_cold_MBps'][-1]:.0f} MB/s (shard reader), "
                     f"{rounds['tensorstore_read_cold_MBps'][-1]:.0f} MB/s (tensorstore)"
                     + (f"; loader batches {rounds['loader_batches_direct_cold_MBps'][-1]:.0f} / "
                        f"{rounds['loader_batches_tensorstore_cold_MBps'][-1]:.0f} MB/s" if loader_batches else "")
                     + f"; load {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    med = statistics.median
    result = {"store": None if scratch is not None else str(store_dir), "filesystem": _filesystem(store_dir),
              "samples": len(store), "store_bytes": store_bytes, "files": len(files),
              "mean_sample_MB": store_bytes / len(store) / 1e6,
              "pass_samples": sum(map(len, batches)), "pass_batches": len(batches), "pass_payload_bytes": payload,
              "batch": {"batch_size": shape.batch_size, "text_len": shape.text_len, "gen_len": shape.gen_len},
              "threads": threads, "piece_mb": piece_bytes / (1 << 20), "repeats": repeats, "page_cache": cache,
              "cpu_count": os.cpu_count(), "rounds": rounds}
    for key, values in rounds.items():
        if key.endswith("MBps") or key.endswith("cpu_cores"):
            result[key] = med(values)
    per_round = lambda num, den: [a / b for a, b in zip(rounds[num], rounds[den])]
    ratios = {"loader_read_vs_disk": per_round("loader_read_cold_MBps", "disk_read_cold_MBps"),
              "loader_read_vs_disk_store_files": per_round("loader_read_cold_MBps", "disk_read_cold_store_files_MBps"),
              "loader_read_vs_disk_parallel": per_round("loader_read_cold_MBps", "disk_read_cold_parallel_MBps"),
              "tensorstore_read_vs_disk": per_round("tensorstore_read_cold_MBps", "disk_read_cold_MBps")}
    if loader_batches:
        ratios["loader_batches_vs_disk"] = per_round("loader_batches_direct_cold_MBps", "disk_read_cold_MBps")
        ratios["loader_batches_tensorstore_vs_disk"] = per_round("loader_batches_tensorstore_cold_MBps",
                                                                 "disk_read_cold_MBps")
    rounds |= {f"ratio_{k}": v for k, v in ratios.items()}
    # Each round's ratio, then the median: the disk's rate drifts with other work between rounds.
    result["ratios"] = {k: med(v) for k, v in ratios.items()}
    result["meets_90_percent"] = result["ratios"]["loader_read_vs_disk"] >= 0.9
    return result


def format_io_table(result: dict) -> str:
    b, r = result["batch"], result["ratios"]
    lines = [
        f"data I/O bench: {result['samples']} samples, {result['store_bytes'] / 1e9:.2f} GB "
        f"({result['mean_sample_MB']:.1f} MB a sample) on {result['filesystem']}; a pass reads "
        f"{result['pass_samples']} samples ({result['pass_payload_bytes'] / 1e9:.2f} GB) in {result['pass_batches']} "
        f"batches of {b['batch_size']} x ({b['text_len']} + {b['gen_len']}) tokens; medians of {result['repeats']} "
        f"rounds, cold ({result['page_cache']}); {result['threads']} threads x {result['piece_mb']:g} MiB reads",
        f"{'':44}{'MB/s':>8}{'vs disk':>9}{'cores':>7}",
        f"{'disk: fresh probe file, 16 MiB reads':44}{result['disk_read_cold_MBps']:>8.0f}",
        f"{'disk: the store files, 16 MiB reads':44}{result['disk_read_cold_store_files_MBps']:>8.0f}"
        f"{result['disk_read_cold_store_files_MBps'] / result['disk_read_cold_MBps']:>9.2f}",
        f"{'disk: the store files, parallel O_DIRECT':44}{result['disk_read_cold_parallel_MBps']:>8.0f}"
        f"{result['disk_read_cold_parallel_MBps'] / result['disk_read_cold_MBps']:>9.2f}",
        f"{'loader read path: shard reader':44}{result['loader_read_cold_MBps']:>8.0f}"
        f"{r['loader_read_vs_disk']:>9.2f}{result['loader_read_cpu_cores']:>7.2f}",
        f"{'loader read path: tensorstore':44}{result['tensorstore_read_cold_MBps']:>8.0f}"
        f"{r['tensorstore_read_vs_disk']:>9.2f}{result['tensorstore_read_cpu_cores']:>7.2f}",
    ]
    if "loader_batches_vs_disk" in r:
        lines += [f"{'Loader batches (read + pack): shard reader':44}{result['loader_batches_direct_cold_MBps']:>8.0f}"
                  f"{r['loader_batches_vs_disk']:>9.2f}",
                  f"{'Loader batches (read + pack): tensorstore':44}"
                  f"{result['loader_batches_tensorstore_cold_MBps']:>8.0f}"
                  f"{r['loader_batches_tensorstore_vs_disk']:>9.2f}"]
    loads = ", ".join(f"{a:.1f}->{z:.1f}" for a, z in result["rounds"]["loadavg_1min"])
    lines.append(f"loader read path / disk cold read: {r['loader_read_vs_disk']:.2f} (rounds: "
                 + ", ".join(f"{x:.2f}" for x in result["rounds"]["ratio_loader_read_vs_disk"])
                 + f"), {'meets' if result['meets_90_percent'] else 'misses'} the 90% goal; vs the store files read "
                 f"sequentially {r['loader_read_vs_disk_store_files']:.2f}, in parallel "
                 f"{r['loader_read_vs_disk_parallel']:.2f}; "
                 f"load average per round {loads} on {result['cpu_count']} cores")
    return "\n".join(lines)

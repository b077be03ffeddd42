"""`xlaopt bench checkpoint`: the disk, xlaopt and Orbax saving and restoring the same sharded
tree, interleaved round by round (the disk here is noisy), medians reported.

A save's time runs until the checkpoint is committed and durable; Orbax gets an `os.sync()`
after its wait, since it does not fsync. Its blocking time is how long `save` kept the caller.
The disk's row is a dd-style durable write of as many bytes: a synchronous save, so it blocks
for all of it. Restores start from a dropped page cache.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xlaopt.benchmarks.disk import drop_page_cache, read_cold_MBps, write_durable_MBps
from xlaopt.benchmarks.memory import PeakRss
from xlaopt.checkpoint import CheckpointManager, Retention
from xlaopt.errors import UserError

NUM_ARRAYS = 32
ROW = 4096  # float32 columns per array row


def sharded_tree(size_bytes: int, mesh: jax.sharding.Mesh) -> dict:
    """`NUM_ARRAYS` float32 arrays of `size_bytes` in all, rows sharded over every device."""
    n = mesh.devices.size
    rows = max(n, size_bytes // (NUM_ARRAYS * ROW * 4) // n * n)
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    make = jax.jit(lambda k: jax.random.normal(k, (rows, ROW), jnp.float32), out_shardings=sharding)
    return {f"layer_{i:02d}": make(jax.random.key(i)) for i in range(NUM_ARRAYS)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _xlaopt_save(tree, where: pathlib.Path):
    manager = CheckpointManager(where, Retention(keep_last=1))
    info = manager.save(1, tree)
    manager.wait()
    return manager, info.blocking_s


def _orbax_save(tree, where: pathlib.Path):
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    t0 = time.perf_counter()
    checkpointer.save((where / "orbax").resolve(), tree)
    blocking_s = time.perf_counter() - t0
    checkpointer.wait_until_finished()
    os.sync()  # Orbax does not fsync; without this we would time the page cache
    return checkpointer, blocking_s


def _xlaopt_restore(manager, tree, where: pathlib.Path):
    return manager.restore(_abstract(tree))[0]


def _orbax_restore(checkpointer, tree, where: pathlib.Path):
    restored = checkpointer.restore((where / "orbax").resolve(), _abstract(tree))
    checkpointer.close()
    return restored


def _round(name: str, tree, nbytes, where: pathlib.Path) -> dict:
    """One contender's save (until durable) and cold restore, checked equal to what was saved."""
    t0 = time.perf_counter()
    handle, blocking_s = _SAVES[name](tree, where)
    save_s = time.perf_counter() - t0
    drop_page_cache([where])
    t0 = time.perf_counter()
    restored = jax.block_until_ready(_RESTORES[name](handle, tree, where))
    restore_s = time.perf_counter() - t0
    _check_equal(tree, restored)
    return {"save_MBps": nbytes / save_s / 1e6, "restore_cold_MBps": nbytes / restore_s / 1e6,
            "blocking_s": blocking_s}


_SAVES = {"xlaopt": _xlaopt_save, "orbax": _orbax_save}
_RESTORES = {"xlaopt": _xlaopt_restore, "orbax": _orbax_restore}


def peak_save_memory(name: str, size_gb: float, where: pathlib.Path) -> int:
    """Peak RSS above the baseline while `name` saves, measured in a fresh process: in this one
    the allocator keeps what earlier rounds freed, and a save reusing it would not show."""
    code = ("import json, pathlib, sys, jax; from xlaopt.benchmarks import checkpoint as c; "
            f"print(json.dumps(c._memory_probe({name!r}, {size_gb!r}, pathlib.Path({str(where)!r}))))")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={len(jax.devices())}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe for {name} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _memory_probe(name: str, size_gb: float, where: pathlib.Path) -> int:
    tree = sharded_tree(int(size_gb * 2**30), jax.make_mesh((len(jax.devices()),), ("fsdp",)))
    jax.block_until_ready(tree)
    with PeakRss() as rss:
        _SAVES[name](tree, where)
    return rss.extra_bytes


def _check_equal(tree, restored) -> None:
    for name in (next(iter(tree)), list(tree)[-1]):
        if not np.array_equal(np.asarray(tree[name]), np.asarray(restored[name])):
            raise AssertionError(f"restored {name} differs from what was saved")


def _host_copy_s(tree) -> float:
    """The device-to-host copy alone: what a save that took a host copy before returning
    would block for at least."""
    t0 = time.perf_counter()
    copies = [np.array(s.data, copy=True) for x in tree.values() for s in x.addressable_shards]
    elapsed = time.perf_counter() - t0
    del copies
    return elapsed


def run(size_gb: float = 1.0, repeats: int = 5, workdir: str | None = None, progress=print) -> dict:
    try:
        import orbax.checkpoint  # noqa: F401
        have_orbax = True
    except ImportError:
        have_orbax = False
        progress("orbax-checkpoint is not installed (pip install 'xlaopt[bench]'): measuring xlaopt only")
    if repeats < 1:
        raise UserError(f"--repeats {repeats}: need at least one round")
    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
    tree = sharded_tree(int(size_gb * 2**30), mesh)
    nbytes = sum(x.nbytes for x in tree.values())
    base = pathlib.Path(workdir or f"/tmp/xlaopt-bench-checkpoint-{os.getpid()}")
    base.mkdir(parents=True, exist_ok=True)
    rounds = {"disk_write_MBps": [], "disk_read_cold_MBps": [], "host_copy_s": [], "xlaopt": [], "orbax": []}
    cache_method, memory = "", {}
    try:
        for r in range(repeats):
            probe = base / "dd.bin"
            rounds["disk_write_MBps"].append(write_durable_MBps(probe, nbytes))
            rounds["disk_read_cold_MBps"].append(read_cold_MBps(probe))
            probe.unlink()
            rounds["host_copy_s"].append(_host_copy_s(tree))
            cache_method = drop_page_cache([base])
            contenders = ["xlaopt"] + (["orbax"] if have_orbax else [])
            if r % 2:  # alternate who goes first: the disk drifts within a round
                contenders.reverse()
            for name in contenders:
                where = base / f"{name}-{r}"
                rounds[name].append(_round(name, tree, nbytes, where))
                shutil.rmtree(where)
            progress(f"round {r + 1}/{repeats}: dd write {rounds['disk_write_MBps'][-1]:.0f} MB/s, "
                     + ", ".join(f"{n} save {rounds[n][-1]['save_MBps']:.0f} MB/s restore "
                                 f"{rounds[n][-1]['restore_cold_MBps']:.0f} MB/s" for n in contenders))
        for name in contenders:
            where = base / f"{name}-memory"
            memory[name] = peak_save_memory(name, size_gb, where)
            shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    result = {"size_bytes": nbytes, "arrays": NUM_ARRAYS, "devices": mesh.devices.size, "repeats": repeats,
              "page_cache": cache_method, "disk_write_MBps": med(rounds["disk_write_MBps"]),
              "disk_read_cold_MBps": med(rounds["disk_read_cold_MBps"]), "host_copy_s": med(rounds["host_copy_s"]),
              "rounds": rounds}
    for name in ("xlaopt", "orbax"):
        if rounds[name]:
            result[name] = {k: med(r[k] for r in rounds[name]) for k in rounds[name][0]}
            # Each save against the dd write of its own round: the disk drifts several-fold
            # between rounds, less within one.
            result[name]["save_vs_disk_write"] = med(r["save_MBps"] / dd for r, dd
                                                     in zip(rounds[name], rounds["disk_write_MBps"]))
            result[name]["peak_rss_bytes"] = memory[name]
    result["disk_write_s"] = nbytes / (result["disk_write_MBps"] * 1e6)
    x = result["xlaopt"]
    result["ratios"] = {"xlaopt_save_vs_disk_write": x["save_MBps"] / result["disk_write_MBps"],
                        "xlaopt_restore_vs_disk_read": x["restore_cold_MBps"] / result["disk_read_cold_MBps"],
                        "xlaopt_peak_rss_vs_bytes": x["peak_rss_bytes"] / nbytes,
                        "xlaopt_blocking_vs_host_copy": x["blocking_s"] / result["host_copy_s"]}
    if "orbax" in result:
        o = result["orbax"]
        result["ratios"] |= {"save_xlaopt_vs_orbax": x["save_MBps"] / o["save_MBps"],
                             "restore_xlaopt_vs_orbax": x["restore_cold_MBps"] / o["restore_cold_MBps"],
                             "blocking_xlaopt_vs_orbax": x["blocking_s"] / o["blocking_s"]}
    return result


def format_table(result: dict) -> str:
    gib = result["size_bytes"] / 2**30
    lines = [f"checkpoint bench: {gib:.2f} GiB in {result['arrays']} float32 arrays sharded over "
             f"{result['devices']} devices; medians of {result['repeats']} interleaved rounds; "
             f"cold reads via {result['page_cache']}; host copy of the tree {result['host_copy_s']:.3f} s",
             f"{'':10}{'blocking s':>11}{'save MB/s':>11}{'x disk':>8}{'restore MB/s':>14}{'peak RSS +MB':>14}",
             f"{'disk (dd)':10}{result['disk_write_s']:>11.3f}{result['disk_write_MBps']:>11.0f}{1:>8.2f}"
             f"{result['disk_read_cold_MBps']:>14.0f}{'':>14}"]
    for name in ("xlaopt", "orbax"):
        if name in result:
            r = result[name]
            lines.append(f"{name:10}{r['blocking_s']:>11.3f}{r['save_MBps']:>11.0f}{r['save_vs_disk_write']:>8.2f}"
                         f"{r['restore_cold_MBps']:>14.0f}{r['peak_rss_bytes'] / 1e6:>14.0f}")
    lines.append("x disk: each round's save over that round's dd write, median of rounds; the disk's blocking "
                 "is its whole durable write")
    lines.append("ratios of medians: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))
    return "\n".join(lines)

"""A separate process for checkpoint tests that need one: killed mid-save, one of several
`jax.distributed` processes, or running out of file size. Run as a script, not collected."""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from xlaopt.checkpoint import CheckpointError, CheckpointManager, Retention  # noqa: E402

SHAPES = {"w0": (512, 2048), "w1": (256, 1024), "bias": (2048,), "step": ()}


def expected(step: int) -> dict:
    rng = np.random.default_rng(step)
    out = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items() if s}
    out["step"] = np.int32(step)
    return out


def sharded(tree: dict, mesh) -> dict:
    def put(x):
        spec = P(mesh.axis_names) if np.ndim(x) else P()
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx])
    return {k: put(v) for k, v in tree.items()}


def target(mesh) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        sharded(expected(0), mesh))


def check(manager, mesh) -> int | None:
    """Restore the newest step and compare it bit for bit with what was saved."""
    step = manager.latest()
    if step is None:
        return None
    restored, meta, _ = manager.restore(target(mesh))
    want = expected(step)
    for k in SHAPES:
        if not np.array_equal(np.asarray(restored[k]), want[k]):
            print(f"MISMATCH {k} at step {step}", flush=True)
            sys.exit(3)
    assert meta == {"step": step}, meta
    return step


def crashloop(root: str) -> None:
    mesh = jax.make_mesh((8,), ("fsdp",))
    manager = CheckpointManager(root, Retention(keep_last=2))
    step = check(manager, mesh)
    print(f"RESTORED {step}", flush=True)
    step = step or 0
    print("READY", flush=True)
    while True:
        step += 1
        manager.save(step, sharded(expected(step), mesh), {"step": step})
        manager.wait()
        print(f"COMMITTED {step}", flush=True)


def distributed(port: str, process_id: str, root: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("fsdp",))
    manager = CheckpointManager(root)
    manager.save(5, sharded(expected(5), mesh), {"step": 5})
    manager.close()
    print("DONE", flush=True)
    jax.distributed.shutdown()


def file_size_limit(root: str, limit: str) -> None:
    import resource
    import signal

    mesh = jax.make_mesh((8,), ("fsdp",))
    manager = CheckpointManager(root)
    manager.save(1, sharded(expected(1), mesh), {"step": 1})
    manager.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
    manager.save(2, sharded(expected(2), mesh), {"step": 2})
    try:
        manager.wait()
    except CheckpointError as e:
        print(f"ERROR {e}", flush=True)
    else:
        print("SAVED despite the limit", flush=True)
    print(f"LATEST {check(manager, mesh)}", flush=True)


if __name__ == "__main__":
    {"crashloop": crashloop, "distributed": distributed, "fsize": file_size_limit}[sys.argv[1]](*sys.argv[2:])

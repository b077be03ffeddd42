"""A separate process for the loader's multi-process resume test: one of several
`jax.distributed` processes reading its own rows and checkpointing, or a single process
resuming from that checkpoint. Run as a script, not collected."""
import json
import pathlib
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from xlaopt.checkpoint import CheckpointManager
from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.loader import Loader, LoaderState
from xlaopt.data.store import SampleStore
from xlaopt.models.registry import get_config

SHAPE = BatchShape(4, 51, 93)
SEED = 11
STEP = 1000  # the checkpoint's step number: any, as long as both runs agree


def config():
    return get_config("cosmos3-tiny", dict(num_layers=2))


def batch_spec(mesh) -> dict:
    """name -> (global shape, dtype, sharding: rows split over the mesh's 'data' axis)."""
    out = {}
    for name, (shape, dtype, axes) in cosmos3_batch_spec(config(), SHAPE).items():
        spec = P(*("data" if a == "batch" else None for a in axes))
        out[name] = (shape, dtype, NamedSharding(mesh, spec))
    return out


def _save_npz(path, batches: list[dict]) -> None:
    np.savez(path, **{f"{k}:{name}": v for k, batch in enumerate(batches) for name, v in batch.items()})


def _state_vector(state: LoaderState) -> np.ndarray:
    return np.array([state.epoch, state.cursor, state.batches, state.skipped, *state.waiting], np.int64)


def shard(port: str, process_id: str, store_dir: str, ckpt_dir: str, out_dir: str, batches: str) -> None:
    """Read this process's rows of the first `batches` batches, then checkpoint as training does:
    every process writes the shards of the state it holds, process 0 commits with the loader
    position as metadata."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id),
                               initialization_timeout=60)
    me, count = jax.process_index(), jax.process_count()
    assert count == 2 and me == int(process_id)
    # Rows go to processes in process order: process p's devices hold the rows its loader reads.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("data",))
    loader = Loader(SampleStore(store_dir), config(), SHAPE, seed=SEED, process_index=me, process_count=count)
    local = [next(loader) for _ in range(int(batches))]
    state = loader.state()
    loader.close()
    # Only process 0's metadata is committed: it is right for all only if every process agrees.
    vector = _state_vector(state)
    lengths = multihost_utils.process_allgather(np.array([len(vector)]))
    assert (lengths == len(vector)).all(), f"loader states of different lengths across processes: {lengths}"
    multihost_utils.assert_equal(vector, "processes disagree on the loader state")

    # The last batch stands in for the training state: global arrays whose rows live on the
    # process that read them, so each process writes its own shards.
    tree = {name: jax.make_array_from_process_local_data(sharding, local[-1][name], shape)
            for name, (shape, _, sharding) in batch_spec(mesh).items()}
    rows = SHAPE.batch_size // count
    for name, array in tree.items():
        axis = cosmos3_batch_spec(config(), SHAPE)[name][2].index("batch")
        for s in array.addressable_shards:
            assert me * rows <= s.index[axis].start < (me + 1) * rows, (name, me, s.index)
    manager = CheckpointManager(ckpt_dir)
    manager.save(STEP, tree, {"data": state.to_json()})
    manager.close()

    out = pathlib.Path(out_dir)
    _save_npz(out / f"rows-{me}.npz", local)
    (out / f"state-{me}.json").write_text(json.dumps(state.to_json()))
    print("DONE", flush=True)
    jax.distributed.shutdown()


def resume(store_dir: str, ckpt_dir: str, out_dir: str, batches: str) -> None:
    """One process: restore the checkpoint the two processes saved and read `batches` more."""
    assert jax.process_count() == 1
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    target = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
              for name, (shape, dtype, sharding) in batch_spec(mesh).items()}
    manager = CheckpointManager(ckpt_dir)
    restored, meta, _ = manager.restore(target, step=STEP)
    manager.close()
    state = LoaderState.from_json(meta["data"])
    loader = Loader(SampleStore(store_dir), config(), SHAPE, seed=SEED, state=state)
    produced = [next(loader) for _ in range(int(batches))]
    out = pathlib.Path(out_dir)
    _save_npz(out / "resumed.npz", produced)
    _save_npz(out / "restored.npz", [{k: np.asarray(v) for k, v in restored.items()}])
    (out / "resumed-from.json").write_text(json.dumps(meta["data"]))
    (out / "resumed-state.json").write_text(json.dumps(loader.state().to_json()))
    loader.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    {"shard": shard, "resume": resume}[sys.argv[1]](*sys.argv[2:])

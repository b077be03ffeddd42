"""Exact resume of the loader across real processes: two `jax.distributed` processes each read
their own rows, stop mid-epoch and checkpoint; one process restores that checkpoint and goes
on. Together they must produce exactly what one uninterrupted process does."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from xlaopt.checkpoint import CheckpointManager
from xlaopt.data.batch import cosmos3_batch_spec
from xlaopt.data.loader import Loader, LoaderState
from xlaopt.data.store import SampleStore
from xlaopt.data.synthetic_store import make_store

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import loader_worker as w  # noqa: E402

from conftest import command_env, finish, free_port  # noqa: E402

WORKER = str(pathlib.Path(__file__).with_name("loader_worker.py"))
# Two devices per process: each holds one row of a process's half of the batch.
ENV = command_env(devices=2)
SAMPLES = 200  # about six batches an epoch: STOP lies mid-epoch 0, TOTAL ends in epoch 1
STOP, TOTAL = 3, 8
TIMEOUT_S = 120


def _worker(*args):
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def _load(path) -> list[dict]:
    with np.load(path) as f:
        batches: dict[int, dict] = {}
        for key in f.files:
            k, name = key.split(":")
            batches.setdefault(int(k), {})[name] = f[key]
    return [batches[k] for k in sorted(batches)]


def _fingerprints(store: SampleStore, width: int) -> dict:
    """Sample id by content (text tokens and latents as packed): how a packed row's segments
    are traced back to the samples they hold."""
    index = {}
    for i, s in enumerate(store.read_many(range(len(store)))):
        x0 = np.zeros((s.n_gen, width), np.float32)
        if s.n_gen:
            x0[:, : s.latents.shape[1]] = s.latents
        index[(np.asarray(s.text, np.int32).tobytes(), x0.tobytes())] = i
    assert len(index) == len(store), "samples with identical content cannot be told apart"
    return index


def _sample_ids(batch: dict, index: dict) -> list[int]:
    ids = []
    for b in range(batch["text_tokens_BT"].shape[0]):
        text_seg, gen_seg = batch["text_segment_ids_BT"][b], batch["gen_segment_ids_BV"][b]
        for seg in range(1, int(max(text_seg.max(), gen_seg.max())) + 1):
            key = (batch["text_tokens_BT"][b][text_seg == seg].tobytes(),
                   batch["gen_x0_BVC"][b][gen_seg == seg].tobytes())
            assert key in index, f"row {b} segment {seg} matches no sample of the store"
            ids.append(index[key])
    return ids


def _assert_batches_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{what}: {name}")


@pytest.mark.slow  # jax.distributed worker processes
def test_two_processes_stop_mid_epoch_and_one_process_resumes_exactly(tmp_path):
    config = w.config()
    make_store(tmp_path / "store", config, SAMPLES, seed=3, shard_bytes=32 << 10)
    store = SampleStore(tmp_path / "store")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()

    port = free_port()
    procs = [_worker("shard", port, i, store.dir, ckpt, out, STOP) for i in range(2)]
    try:
        # The uninterrupted run, while the two processes work.
        single = Loader(store, config, w.SHAPE, seed=w.SEED)
        reference, states = [], []
        for _ in range(TOTAL):
            reference.append(next(single))
            states.append(single.state())
        single.close()
    finally:
        finish(procs, TIMEOUT_S, "DONE")
    finish([_worker("resume", store.dir, ckpt, out, TOTAL - STOP)], TIMEOUT_S, "DONE")

    # The run stops mid-epoch with samples waiting, and the resumed part crosses into the next
    # epoch: the state must carry both the cursor and the waiting line.
    stopped = states[STOP - 1]
    assert stopped.epoch == 0 and 0 < stopped.cursor < SAMPLES and stopped.waiting, stopped
    assert states[-1].epoch == 1, states[-1]

    # Each process's rows, in process order, are the uninterrupted run's global batches.
    halves = [_load(out / f"rows-{p}.npz") for p in range(2)]
    assert [len(h) for h in halves] == [STOP, STOP]
    spec = cosmos3_batch_spec(config, w.SHAPE)
    for k in range(STOP):
        for name, (_, _, axes) in spec.items():
            axis = axes.index("batch")
            assert halves[0][k][name].shape[axis] == w.SHAPE.batch_size // 2
            np.testing.assert_array_equal(np.concatenate([h[k][name] for h in halves], axis=axis),
                                          reference[k][name], err_msg=f"two-process batch {k}: {name}")
    for p in range(2):
        assert LoaderState.from_json(json.loads((out / f"state-{p}.json").read_text())) == stopped

    # The checkpoint both processes wrote holds their rows and the position after batch STOP-1.
    manager = CheckpointManager(ckpt)
    assert manager.steps() == [w.STEP] and manager.manifest(w.STEP)["process_count"] == 2
    assert LoaderState.from_json(json.loads((out / "resumed-from.json").read_text())) == stopped
    _assert_batches_equal(_load(out / "restored.npz")[0], reference[STOP - 1], "restored checkpoint")

    # One process from there on produces exactly the uninterrupted run's remaining batches.
    resumed = _load(out / "resumed.npz")
    assert len(resumed) == TOTAL - STOP
    for k, batch in enumerate(resumed, start=STOP):
        _assert_batches_equal(batch, reference[k], f"resumed batch {k}")
    assert LoaderState.from_json(json.loads((out / "resumed-state.json").read_text())) == states[-1]

    # No sample lost or repeated: what the rows hold plus what still waits is exactly the stream
    # read so far (all of epoch 0, the start of epoch 1), each sample as often as it was read.
    index = _fingerprints(store, config.generator_in_dim)
    placed = [i for k in range(STOP) for h in halves for i in _sample_ids(h[k], index)]
    placed += [i for batch in resumed for i in _sample_ids(batch, index)]
    assert placed == [i for batch in reference for i in _sample_ids(batch, index)]
    end = states[-1]
    perms = [np.random.default_rng([w.SEED, e]).permutation(SAMPLES) for e in range(end.epoch + 1)]
    stream = np.concatenate(perms[:-1] + [perms[-1][: end.cursor]])
    assert end.skipped == 0 and sorted(placed + list(end.waiting)) == sorted(stream.tolist())

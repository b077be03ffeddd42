"""Checkpoints across processes: SIGKILL mid-save, two `jax.distributed` processes saving one
checkpoint restored by one, a disk that refuses writes, and the layout read by plain tensorstore."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from xlaopt.checkpoint import CheckpointManager

from conftest import command_env, finish, free_port, needs_devices

WORKER = str(pathlib.Path(__file__).with_name("ckpt_worker.py"))
ENV = command_env(devices=8)


def _worker(*args, env=ENV):
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _expected_and_target():
    sys.path.insert(0, str(pathlib.Path(WORKER).parent))
    import ckpt_worker

    return ckpt_worker


@pytest.mark.slow  # thirteen worker processes in turn, each starting JAX
def test_sigkill_at_many_points_never_loses_the_last_committed_step(tmp_path):
    root = tmp_path / "ckpt"
    committed = None  # the newest step a worker reported committed before it was killed
    delays = [0.0, 0.03, 0.07, 0.11, 0.16, 0.2, 0.25, 0.31, 0.38, 0.45, 0.55, 0.7]
    for delay in delays + [None]:
        proc = _worker("crashloop", root)
        first = proc.stdout.readline().split()
        assert first and first[0] == "RESTORED", (first, proc.stderr.read() if proc.poll() is not None else "")
        restored = None if first[1] == "None" else int(first[1])
        # The worker checked the restored step bit for bit (it exits 3 on a mismatch); the step
        # is at least the last one reported committed (one committed unreported may follow).
        if committed is not None:
            assert restored is not None and restored >= committed, (restored, committed)
        assert proc.stdout.readline().strip() == "READY"
        if delay is None:  # a final worker: restores and then completes saves undisturbed
            steps = [proc.stdout.readline().split() for _ in range(3)]
            proc.kill()
            proc.wait()
            assert [s[0] for s in steps] == ["COMMITTED"] * 3
            break
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
        done = [int(line.split()[1]) for line in out.splitlines() if line.startswith("COMMITTED")]
        committed = max(done, default=restored)
    steps = CheckpointManager(root).steps()
    assert len(steps) == 2 and not [p for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.slow  # jax.distributed worker processes
@needs_devices(8)
def test_two_processes_save_one_checkpoint_that_one_process_restores(tmp_path):
    env, port = command_env(devices=4), free_port()
    finish([_worker("distributed", port, i, tmp_path, env=env) for i in range(2)], 240, "DONE")
    w = _expected_and_target()
    manager = CheckpointManager(tmp_path)
    assert manager.steps() == [5] and manager.manifest(5)["process_count"] == 2
    for mesh in (jax.make_mesh((8,), ("fsdp",)), jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])):
        restored, meta, _ = manager.restore(w.target(mesh))
        for k, v in w.expected(5).items():
            np.testing.assert_array_equal(np.asarray(restored[k]), v)
        assert meta == {"step": 5}


def test_a_disk_that_refuses_writes_fails_the_save_and_keeps_the_last_checkpoint(tmp_path):
    proc = _worker("fsize", tmp_path, 100_000)  # the 512 KiB shard files of w0 exceed it
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    error = next(line for line in out.splitlines() if line.startswith(("ERROR", "SAVED")))
    assert error.startswith("ERROR save of step 2") and "step 1 is intact" in error, error
    assert "File too large" in error or "EFBIG" in error or "too large" in error.lower(), error
    assert "LATEST 1" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "xlaopt-checkpoints.json"]


READER = r"""
import json, pathlib, sys
import numpy as np, tensorstore as ts
step = pathlib.Path(sys.argv[1])
manifest = json.loads((step / "manifest.json").read_text())
out = {}
for leaf in manifest["leaves"]:
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step / "arrays" / leaf["name"])}}).result()
    assert list(array.shape) == leaf["shape"] and array.dtype.name == leaf["dtype"], leaf
    out[leaf["name"]] = array.read().result()
np.savez(sys.argv[2], **out)
assert not [m for m in sys.modules if m.startswith("xlaopt")]
"""


def test_layout_reads_back_with_plain_tensorstore(tmp_path):
    w = _expected_and_target()
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(5, w.sharded(w.expected(5), jax.make_mesh((8,), ("fsdp",))), {"step": 5})
    manager.wait()
    read = subprocess.run([sys.executable, "-c", READER, str(tmp_path / "ckpt/step_00000005"), str(tmp_path / "o.npz")],
                          capture_output=True, text=True)
    assert read.returncode == 0, read.stderr[-3000:]
    with np.load(tmp_path / "o.npz") as got:
        assert sorted(got.files) == sorted(w.expected(5))
        for k, v in w.expected(5).items():
            np.testing.assert_array_equal(got[k], v)

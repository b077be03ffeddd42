"""`xlaopt train` as a real multi-process job: two `jax.distributed` processes (gloo), each
bringing half the mesh's devices and reading only its own rows of every batch, train and
checkpoint mid-epoch; one process resumes from that checkpoint on the whole mesh. Losses and
the data position must be those of one uninterrupted single-process run."""
import json
import subprocess
import sys

import numpy as np
import pytest

from xlaopt.data.synthetic_store import make_store
from xlaopt.models.registry import get_config

from conftest import command_env, finish, free_port

MODEL = ["--model", "cosmos3-tiny", "--set", "num_layers=2", "--mesh", "data=2,fsdp=2,tensor=2",
         "--dtype", "float32", "--batch-size", "4", "--no-progress"]
STOP, TOTAL = 2, 4
TIMEOUT_S = 300
# Float32 throughout; the two runs differ only in how cross-device sums are ordered (gloo
# between processes vs XLA's in-process all-reduce): a few ulps, well under this.
LOSS_RTOL = 1e-5


def _train(*args):
    # Each process brings the devices its share of the mesh needs. The suite's fast compile: the
    # runs are compared within a tolerance, all compiled alike.
    return subprocess.Popen([sys.executable, "-m", "xlaopt.cli", "train", *MODEL, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=command_env())


@pytest.mark.slow  # three `xlaopt train` processes, two of them a jax.distributed job
def test_two_process_training_resumes_on_one_process_exactly(tmp_path):
    store = tmp_path / "store"
    make_store(store, get_config("cosmos3-tiny"), 300, seed=1, shard_bytes=32 << 10)
    port = free_port()
    job = [_train("--data", store, "--steps", STOP, "--ckpt", tmp_path / "ckpt", "--json", tmp_path / "two.json",
                  "--coordinator", f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", i) for i in range(2)]
    single = _train("--data", store, "--steps", TOTAL, "--json", tmp_path / "single.json")
    finish(job + [single], TIMEOUT_S)
    finish([_train("--data", store, "--steps", TOTAL, "--ckpt", tmp_path / "ckpt", "--resume",
                   "--json", tmp_path / "resumed.json")], TIMEOUT_S)

    two, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "single"))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["checkpoint"]["resumed_from"] == STOP
    losses = [r["loss"] for r in two["steps"]] + [r["loss"] for r in resumed["steps"]]
    reference = [r["loss"] for r in one["steps"]]
    assert len(losses) == len(reference) == TOTAL
    np.testing.assert_allclose(losses, reference, rtol=LOSS_RTOL, atol=0)
    # Process 0 read only its half of the rows, yet the job counts the whole batch's tokens.
    assert two["data"]["rows_read"] == [0, 2] and one["data"]["rows_read"] == [0, 4]
    assert [r["tokens"] for r in two["steps"]] == [r["tokens"] for r in one["steps"][:STOP]]
    # The data position after the last step is the uninterrupted run's, sample for sample.
    assert resumed["data"]["state"] == one["data"]["state"]
    assert two["data"]["state"]["epoch"] == 0 and two["data"]["state"]["cursor"] > 0

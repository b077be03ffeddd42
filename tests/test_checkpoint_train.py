"""Training with checkpoints: a resumed run continues exactly where an uninterrupted one is,
data position included; `xlaopt ckpt` lists, inspects and verifies what training wrote."""
import json
import shutil

import numpy as np
import pytest

from xlaopt.cli import main
from xlaopt.data.store import StoreWriter
from xlaopt.data.synthetic_cosmos import CosmosSamples

from conftest import needs_devices

TINY = ["--model", "cosmos3-tiny", "--set", "num_layers=2", "--mesh", "fsdp=4,tensor=2", "--no-progress"]


@pytest.fixture(scope="module")
def store(tiny_config, tmp_path_factory):
    gen, rng = CosmosSamples(tiny_config, 0), np.random.default_rng(5)
    path = tmp_path_factory.mktemp("ckpt-train") / "store"
    StoreWriter(path, gen.widths(), shard_bytes=128 << 10).add_all(gen.draw(rng) for _ in range(300)).close()
    return str(path)


LLAMA = ["--model", "llama-tiny", "--set", "num_layers=2", "--mesh", "fsdp=4,tensor=2", "--no-progress"]


def _train(tmp_path, name, *args, model=TINY):
    out = tmp_path / f"{name}.json"
    assert main(["train", *model, "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


@needs_devices(8)
def test_resumed_run_matches_uninterrupted_run_bit_for_bit(tmp_path, store, capsys):
    whole = _train(tmp_path, "whole", "--steps", "6", "--data", store, "--ckpt", str(tmp_path / "a"),
                   "--ckpt-every", "3", "--keep", "5", "--resume")  # --resume on an empty dir: a fresh start
    assert whole["checkpoint"]["resumed_from"] is None and whole["checkpoint"]["committed"] == [3, 6]
    assert [s["step"] for s in whole["checkpoint"]["saves"]] == [3, 6]
    # As if the run had died after step 3's checkpoint: the same directory without step 6.
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("step_00000006"))
    rest = _train(tmp_path, "rest", "--steps", "6", "--data", store, "--ckpt", str(tmp_path / "b"), "--resume")
    assert rest["checkpoint"]["resumed_from"] == 3
    assert [s["step"] for s in rest["steps"]] == [3, 4, 5]
    # Same state, same batches, same program: the same losses exactly.
    assert [s["loss"] for s in rest["steps"]] == [s["loss"] for s in whole["steps"][3:]]
    assert rest["data"]["state"] == whole["data"]["state"]
    # And the same final state, leaf for leaf and bit for bit, with the same data position.
    assert main(["ckpt", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--step", "6"]) == 0
    # Resuming a finished run does nothing and says so.
    assert main(["train", *TINY, "--steps", "6", "--data", store, "--ckpt", str(tmp_path / "b"), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().out

    # The catalogue reads what training wrote.
    assert main(["ckpt", "ls", str(tmp_path / "a"), "--json", str(tmp_path / "ls.json")]) == 0
    assert [r["step"] for r in json.loads((tmp_path / "ls.json").read_text())["steps"]] == [3, 6]
    assert main(["ckpt", "inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "step 6:" in out and "params/" in out and "model cosmos3-tiny" in out
    assert main(["ckpt", "verify", str(tmp_path / "a")]) == 0
    chunk = next((tmp_path / "a/step_00000003/arrays/params").rglob("c/*"))
    chunk = chunk if chunk.is_file() else next(p for p in chunk.rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 1
    chunk.write_bytes(data)
    assert main(["ckpt", "verify", str(tmp_path / "a")]) == 1
    out = capsys.readouterr().out
    assert "step 3: 1 fault(s)" in out and str(chunk) in out and "step 6: ok" in out


@needs_devices(8)
@pytest.mark.parametrize("before, after", [("full", "none"), ("none", "full")])
def test_a_checkpoint_resumes_under_another_execution_config(tmp_path, before, after):
    """Recomputation is how a step runs, not what it computes: a run checkpointed with one remat
    policy continues under the other, on the losses the uninterrupted run has."""
    from xlaopt.runtime.verify import TOLERANCES

    common = ["--steps", "4", "--ckpt", str(tmp_path / "ckpt"), "--resume"]
    # `first` runs the 4 steps uninterrupted (its saves only read the state).
    first = _train(tmp_path, "first", "--exec", f"remat={before}", *common, "--ckpt-every", "2", model=LLAMA)
    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")
    rest = _train(tmp_path, "rest", "--exec", f"remat={after}", *common, model=LLAMA)
    assert first["execution"]["remat"] == before and rest["execution"]["remat"] == after
    assert rest["checkpoint"]["resumed_from"] == 2 and [s["step"] for s in rest["steps"]] == [2, 3]
    loss_tol = TOLERANCES["bfloat16"][0]
    for got, want in zip(rest["steps"], first["steps"][2:]):
        assert abs(got["loss"] - want["loss"]) <= loss_tol * abs(want["loss"])


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, capsys):
    import dataclasses

    from xlaopt.checkpoint import CheckpointManager
    from xlaopt.models.registry import get_config

    config = json.loads(json.dumps(dataclasses.asdict(get_config("cosmos3-tiny", {"num_layers": 4}))))
    manager = CheckpointManager(tmp_path)
    manager.save(2, {"x": np.ones(2, np.float32)}, {"model": "cosmos3-tiny", "config": config,
                                                     "seed": 0, "batch": {}, "data": None})
    manager.wait()
    assert main(["train", *TINY, "--steps", "4", "--ckpt", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds a checkpoint of cosmos3-tiny" in err and "num_layers: saved 4, now 2" in err


def test_a_checkpoint_older_than_a_config_field_resumes_at_its_default():
    """A config field added after a checkpoint was saved is absent from its metadata: the run
    that saved it used the field's default, so it matches a run at the default and no other."""
    import dataclasses

    from xlaopt.checkpoint import CheckpointError
    from xlaopt.models.registry import get_config
    from xlaopt.program import TrainProgram
    from xlaopt.runtime.train import _check_same_run, _run_meta

    program = TrainProgram(get_config("llama-tiny"))
    old = json.loads(json.dumps(_run_meta(program, None)))
    del old["config"]["qk_norm"]  # saved before the field existed
    _check_same_run(old, program, "ckpt")
    qk_norm = dataclasses.replace(program, model=dataclasses.replace(program.model, qk_norm=True))
    with pytest.raises(CheckpointError, match="qk_norm: saved False, now True"):
        _check_same_run(old, qk_norm, "ckpt")
    # Saved while remat and attention were model fields: they are execution settings now, never compared.
    older = json.loads(json.dumps(_run_meta(program, None)))
    older["config"].update(remat=True, attention="io_only", attention_block=64)
    del older["execution"]
    _check_same_run(older, program, "ckpt")


@pytest.mark.parametrize("argv,message", [
    (["ckpt", "ls", "/nonexistent/ckpt"], "no such checkpoint directory"),
    (["train", "--model", "cosmos3-tiny", "--resume"], "--resume and --ckpt-every need --ckpt DIR"),
    (["train", "--model", "cosmos3-tiny", "--ckpt", "x", "--ckpt-every", "0"], "--ckpt-every 0"),
])
def test_checkpoint_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err

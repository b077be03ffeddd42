"""The ResNet family: torchvision's sizes, synchronised batch norm (the data-parallel step's
statistics are the whole batch's), running averages in the train state and the checkpoint."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt import api
from xlaopt.checkpoint import CheckpointManager
from xlaopt.cli import main
from xlaopt.compile import compile_program
from xlaopt.families import family_of
from xlaopt.models.registry import ConfigError, get_config
from xlaopt.models.resnet import BATCH_MOMENTS, ResNet, forward_flops
from xlaopt.step import param_count

from conftest import needs_devices

TINY = ["--model", "resnet-tiny", "--no-progress"]


def test_resnet50_is_torchvisions():
    """torchvision.models.resnet50: 25,557,032 parameters and 4.09 GMACs a 224 x 224 image."""
    assert abs(param_count(api.build_program("resnet50")) - 25_557_032) / 25_557_032 < 0.02
    assert forward_flops(get_config("resnet50")) / 2 == pytest.approx(4.09e9, rel=0.01)


def _moments(mesh: str):
    """The batch moments of every norm in one gradient step of resnet-tiny, float32, on `mesh`."""
    program, _ = api.optimize(api.build_program("resnet-tiny", mesh, batch=(16, 1, 0),
                                                execution={"compute_dtype": "float32"}))
    compiled = compile_program(program)
    key = jax.random.key(0)
    state = compiled.init(jax.random.fold_in(key, 0))
    batch = family_of(program.model).synthetic(program.model, program.settings.batch, 0).batch(0)
    _, metrics, _ = compiled.grads(state.params, compiled.put_batch(batch), jax.random.fold_in(key, 1))
    return jax.tree.map(np.asarray, metrics[BATCH_MOMENTS]), state.model_state


@needs_devices(8)
def test_data_parallel_batch_statistics_are_the_whole_batchs():
    """Each norm's mean and variance on data=8 (2 images a device) equal one device's over all 16
    images: synchronised batch norm. Per-device statistics would differ by O(1/sqrt(2)) of a
    standard deviation; float32 reordering by ~1e-6 relative."""
    sharded, running = _moments("data=8")
    whole, _ = _moments("")
    flat = jax.tree_util.tree_leaves_with_path(sharded)
    assert len(flat) == 2 * 12  # mean and var of 12 norms: the stem's, 2 in each of 4 blocks, 3 shortcuts
    for (path, got), want in zip(flat, jax.tree.leaves(whole)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert jax.tree.structure(running) == jax.tree.structure(sharded)  # the train state holds their averages


def test_inference_normalises_with_the_running_averages():
    """With train=False no image's logits depend on the others in its batch."""
    config = get_config("resnet-tiny")
    batch = family_of(config).synthetic(config, api.build_program(config).settings.batch, 0).batch(0)
    batch = jax.tree.map(jnp.asarray, batch)
    variables = ResNet(config, jnp.float32).init(jax.random.key(0), batch)
    eval_model = ResNet(config, jnp.float32, train=False)
    logits = eval_model.apply(variables, batch)
    halved = eval_model.apply(variables, jax.tree.map(lambda a: a[:4], batch))
    np.testing.assert_allclose(halved, logits[:4], rtol=1e-5, atol=1e-5)
    train_logits, _ = ResNet(config, jnp.float32).apply(variables, batch, mutable=["batch_stats"])
    assert not np.allclose(train_logits, logits, atol=1e-3)  # training normalises with the batch's own


@needs_devices(8)
@pytest.mark.parametrize("mesh", ["data=8", "data=2,fsdp=4"])
def test_cli_verify_resnet(mesh, tmp_path):
    out = tmp_path / "verify.json"
    assert main(["verify", "--model", "resnet-tiny", "--mesh", mesh, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ok"]


@needs_devices(4)
def test_training_lowers_loss_and_checkpoints_the_running_averages(tmp_path):
    """A run resumed from step 2's checkpoint ends with the uninterrupted run's running averages
    bit for bit: they are saved and restored with the state (a fresh start of them would differ)."""
    def train(name, ckpt, *args):
        out = tmp_path / f"{name}.json"
        assert main(["train", *TINY, "--mesh", "data=4", "--json", str(out), "--ckpt", str(ckpt), *args]) == 0
        return json.loads(out.read_text())

    whole = train("whole", tmp_path / "a", "--steps", "24", "--ckpt-every", "12")
    assert whole["loss_last5_mean"] < (2 / 3) * whole["loss_first5_mean"], whole
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("step_00000024"))
    rest = train("rest", tmp_path / "b", "--steps", "24", "--resume")
    assert rest["checkpoint"]["resumed_from"] == 12

    compiled = compile_program(api.optimize(api.build_program("resnet-tiny", "data=4"))[0])
    states = [compiled.restore_state(CheckpointManager(tmp_path / d), 24)[0].model_state for d in "ab"]
    init = compiled.init(jax.random.key(0)).model_state
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.allclose(np.asarray(a), np.asarray(f)) for a, f in zip(jax.tree.leaves(states[0]),
                                                                           jax.tree.leaves(init)))


def test_bad_resnet_sizes_are_refused():
    with pytest.raises(ConfigError, match="image_size=30 must be a multiple of 8"):
        get_config("resnet-tiny", {"image_size": 30})
    with pytest.raises(ConfigError, match="block='dense'"):
        get_config("resnet-tiny", {"block": "dense"})


def test_hierarchical_grads_refuses_batch_statistics():
    """Its shard_map would make each device normalise with its own rows' moments."""
    _, records = api.optimize(api.build_program("resnet-tiny", "data=8"), topology="h100:2x4")
    skipped = {r.name: r.report.get("skipped", "") for r in records}
    assert "keeps batch statistics" in skipped["hierarchical-grads"]

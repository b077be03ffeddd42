"""float16 training with dynamic loss scaling: the scale's rule, the skipped step, training,
micro-batches and checkpoints. One float16 program is compiled for the step tests: the scale
is state, so an overflow is forced by handing the step a huge scale, not by recompiling."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.checkpoint import CheckpointManager
from xlaopt.compile import compile_program
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.families import family_of
from xlaopt.loss_scale import LossScale, next_scale
from xlaopt.models.registry import get_config
from xlaopt.program import TrainProgram
from xlaopt.runtime.verify import compare, one_step_grads, reference_program

FP16 = ExecutionConfig(compute_dtype="float16", loss_scale_growth_interval=2)


@pytest.fixture(scope="module")
def program():
    return TrainProgram(get_config("llama-tiny", {"num_layers": 2}), execution=FP16)


@pytest.fixture(scope="module")
def compiled(program):
    return compile_program(program)


@pytest.fixture(scope="module")
def batches(program):
    data = family_of(program.model).synthetic(program.model, program.settings.batch, 0)
    return [data.batch(i) for i in range(4)]


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("changes, match", [
    ({"loss_scale_init": 1000.0}, "loss_scale_init=1000.0 must be a power of two"),
    ({"loss_scale_init": 0.0}, "must be a power of two"),
    ({"loss_scale_init": float("inf")}, "must be a power of two"),
    ({"loss_scale_init": 2.0**200}, "between 2\\^-126 and 2\\^127"),
    ({"loss_scale_growth_interval": 0}, "loss_scale_growth_interval=0 must be at least 1"),
    ({"compute_dtype": "float8"}, "use one of bfloat16, float16, float32"),
])
def test_bad_settings_are_refused_naming_the_fix(changes, match):
    with pytest.raises(UserError, match=match):
        ExecutionConfig(**changes)


def test_only_float16_carries_a_loss_scale():
    for dtype in ("bfloat16", "float32"):
        program = TrainProgram(get_config("llama-tiny", {"num_layers": 2}), execution=ExecutionConfig(compute_dtype=dtype))
        assert compile_program(program).abstract_state.loss_scale is None  # no leaves: checkpoints unchanged


def test_scale_rule():
    scale = LossScale(jnp.float32(8.0), jnp.int32(0))
    good = next_scale(scale, jnp.bool_(True), 2)
    assert (float(good.value), int(good.good_steps)) == (8.0, 1)
    grown = next_scale(good, jnp.bool_(True), 2)
    assert (float(grown.value), int(grown.good_steps)) == (16.0, 0)  # doubled after 2 finite steps, count restarts
    halved = next_scale(good, jnp.bool_(False), 2)
    assert (float(halved.value), int(halved.good_steps)) == (4.0, 0)  # an overflow also resets the run of good steps


def test_float16_trains_and_the_scale_grows(compiled, batches):
    state = compiled.init(jax.random.key(0))
    key = jax.random.key(1)
    losses, scales = [], []
    for _ in range(4):  # one batch again and again: its loss must fall every step
        state, metrics = compiled.train_step(state, compiled.put_batch(batches[0]), key)
        losses.append(float(metrics["loss"]))
        scales.append(float(metrics["loss_scale"]))
        assert float(metrics["skipped"]) == 0.0
    assert scales == [2.0**15, 2.0**15, 2.0**16, 2.0**16]  # growth interval 2
    assert float(state.loss_scale.value) == 2.0**17 and int(state.step) == 4
    # The warmup's first learning rate is 0, so the first update changes nothing; measured
    # 8.83, 8.83, 7.78, 5.83.
    assert losses[1] == losses[0] and losses[0] > losses[2] > losses[3] and losses[3] < losses[0] - 1, losses


def test_overflow_skips_the_update_and_halves_the_scale(compiled, batches):
    state = compiled.init(jax.random.key(0))
    # 2^100 times any cotangent is far past float16's largest value (65504): the backward overflows.
    huge = jax.device_put(LossScale(jnp.float32(2.0**100), jnp.int32(1)), compiled.state_shardings.loss_scale)
    state = state._replace(loss_scale=huge)
    before = _host(state)  # the step donates its input
    state, metrics = compiled.train_step(state, compiled.put_batch(batches[0]), jax.random.key(1))
    assert float(metrics["skipped"]) == 1.0 and float(metrics["loss_scale"]) == 2.0**100
    assert np.isfinite(float(metrics["loss"])) and not np.isfinite(float(metrics["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, _host(state.params), before.params)
    jax.tree.map(np.testing.assert_array_equal, _host(state.opt_state), before.opt_state)  # AdamW's count too
    assert int(state.step) == 1  # the batch was consumed
    assert float(state.loss_scale.value) == 2.0**99 and int(state.loss_scale.good_steps) == 0


def test_micro_batches_scale_each_slice(program):
    """Accumulated float16 gradients match the float32 ones within float16's tolerance: a slice
    left scaled (or unscaled twice) would be off by a factor of 2^15."""
    fp16 = program.replace(execution=dataclasses.replace(FP16, micro_batches=2))
    result = compare(one_step_grads(fp16), one_step_grads(reference_program(fp16)), "float16")
    assert result["ok"], result
    assert result["max_rel_diff_grads"] > 0  # the two really computed in different dtypes


def test_loss_scale_checkpoints_and_restores_across_dtypes(compiled, program, batches, tmp_path):
    state = compiled.init(jax.random.key(0))
    state, _ = compiled.train_step(state, compiled.put_batch(batches[0]), jax.random.key(1))
    state, _ = compiled.train_step(state, compiled.put_batch(batches[1]), jax.random.key(1))
    saved = _host(state)
    assert float(saved.loss_scale.value) == 2.0**16  # grown: restoring the initial scale would differ
    manager = CheckpointManager(tmp_path / "fp16")
    manager.save(2, state)
    manager.close()
    restored, _ = compiled.restore_state(manager, 2)
    jax.tree.map(np.testing.assert_array_equal, _host(restored), saved)

    bf16 = compile_program(program.replace(execution=dataclasses.replace(FP16, compute_dtype="bfloat16")))
    dropped, _ = bf16.restore_state(manager, 2)  # a bf16 run ignores the float16 run's scale
    assert dropped.loss_scale is None
    jax.tree.map(np.testing.assert_array_equal, _host(dropped.params), saved.params)

    manager = CheckpointManager(tmp_path / "bf16")
    manager.save(2, dropped)
    manager.close()
    fresh, _ = compiled.restore_state(manager, 2)  # a float16 run from a bf16 checkpoint starts its scale afresh
    assert float(fresh.loss_scale.value) == FP16.loss_scale_init and int(fresh.loss_scale.good_steps) == 0
    jax.tree.map(np.testing.assert_array_equal, _host(fresh.params), saved.params)


def test_cli_train_reports_skipped_steps_and_resumes_in_another_dtype(tmp_path, capsys):
    """Through `xlaopt train`: overflowing steps are counted, and the float16 run's checkpoint
    resumes under bfloat16 (any execution config resumes)."""
    import json

    from xlaopt.cli import main

    args = ["train", "--model", "llama-tiny", "--set", "num_layers=2", "--no-progress", "--ckpt", str(tmp_path / "c")]
    out = tmp_path / "fp16.json"
    assert main([*args, "--steps", "2", "--dtype", "float16", "--exec", f"loss_scale_init={2.0**100}",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["skipped_steps"] == 2 and [s["loss_scale"] for s in result["steps"]] == [2.0**100, 2.0**99]
    assert "2 updates skipped on float16 overflow" in capsys.readouterr().out
    out = tmp_path / "bf16.json"
    assert main([*args, "--steps", "3", "--dtype", "bfloat16", "--resume", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["checkpoint"]["resumed_from"] == 2 and [s["step"] for s in result["steps"]] == [2]
    assert result["skipped_steps"] == 0 and "loss_scale" not in result["steps"][0]

"""Sharded equals single-device, on the meshes the design promises to support."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from xlaopt.cli import main
from xlaopt.compile import compile_program
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram
from xlaopt.runtime.verify import compare, initial_params, one_step_grads
from xlaopt.transforms import GradTransform

from conftest import COSMOS3_TINY, LLAMA_TINY, SMALL, needs_devices

FP32 = ExecutionConfig(compute_dtype="float32")


def _grads(config, mesh: str, transforms=(), execution=FP32, applied=()):
    program = TrainProgram(config, MeshSpec.parse(mesh), execution=execution, grad_transforms=transforms)
    program, records = run_pipeline(program, pipeline())
    assert {r.name for r in records if r.changed} >= set(applied), records
    return one_step_grads(program)


@pytest.fixture(scope="module")
def reference(tiny_config):
    return _grads(tiny_config, "")


@needs_devices(8)
@pytest.mark.parametrize("mesh", ["data=8", "fsdp=8", "fsdp=4,tensor=2", "context=2,fsdp=2,tensor=2"])
def test_sharded_matches_single_device(tiny_config, reference, mesh):
    result = compare(_grads(tiny_config, mesh), reference, "float32")
    assert result["ok"], result
    assert result["max_rel_diff_grads"] > 0 or mesh == "data=8"  # partitioning really reordered sums


@needs_devices(8)
@pytest.mark.parametrize("config, mesh, execution", [
    (COSMOS3_TINY, "fsdp=4,tensor=2", FP32),
    (COSMOS3_TINY, "context=2,fsdp=2,tensor=2", FP32),
    (LLAMA_TINY, "stage=2,fsdp=2,tensor=2", dataclasses.replace(FP32, layer_stack="pipeline")),
], ids=["cosmos3-fsdp-tensor", "cosmos3-context-fsdp-tensor", "llama-pipeline"])
def test_a_sharded_init_makes_one_devices_parameters_bit_for_bit(config, mesh, execution):
    """verify starts every program it compares from one device's initial parameters
    (`initial_params`), while a training run makes its own on its mesh: those are the same
    parameters, bit for bit (JAX's partitionable threefry), also with the layers split over stages."""
    program, _ = run_pipeline(TrainProgram(config, MeshSpec.parse(mesh), execution=execution), pipeline())
    key = jax.random.fold_in(jax.random.key(program.settings.seed), 0)
    params = compile_program(program).init(key).params
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))
    ours = jax.tree_util.tree_flatten_with_path(params)[0]
    single = jax.tree.leaves(initial_params(program))
    assert len(ours) == len(single)
    for (path, a), b in zip(ours, single):
        assert np.asarray(a).dtype == b.dtype and np.asarray(a).tobytes() == b.tobytes(), jax.tree_util.keystr(path)


@needs_devices(8)
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,tensor=2", "context=2,fsdp=2,tensor=2"])
def test_segment_attention_sharded_matches_dense_single_device(tiny_config, reference, mesh):
    """Segment-aware attention runs per device over the batch's mesh axes (a shard_map) and still
    gives the single-device dense step's loss and gradients."""
    segment = dataclasses.replace(FP32, attention="segment", attention_block=16)
    ulysses = ("ulysses-attention",) if "context" in mesh else ()  # tensor x context: Ulysses' all-to-alls
    result = compare(_grads(tiny_config, mesh, execution=segment, applied=ulysses), reference, "float32")
    assert result["ok"], result


class Corrupt(GradTransform):
    name = "corrupt"

    def apply(self, grad_fn):
        def wrapped(params, batch, key):
            loss, metrics, grads = grad_fn(params, batch, key)
            grads = dict(grads, lm_head_DE=grads["lm_head_DE"] * 1.01)
            return loss, metrics, grads
        return wrapped


def test_verify_catches_a_wrong_gradient(tiny_config, reference):
    """A 1% error in one gradient leaf, the size of a partial reduction bug, fails the check."""
    result = compare(_grads(tiny_config, "", (Corrupt(),)), reference, "float32")
    assert not result["ok"] and result["worst_grad"] == "['lm_head_DE']"
    assert result["max_rel_diff_grads"] == pytest.approx(0.01, rel=1e-3)


@needs_devices(8)
def test_cli_verify_data2_fsdp2_tensor2(tmp_path, capsys):
    out = tmp_path / "verify.json"
    sets = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")]
    rc = main(["verify", "--model", "cosmos3-tiny", *sets, "--mesh", "data=2,fsdp=2,tensor=2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"], result
    assert set(result) >= {"max_abs_diff_loss", "max_rel_diff_grads", "ok"}
    assert result["mesh"] == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2, "context": 1}
    assert ": ok" in capsys.readouterr().out


LLAMA = ["--model", "llama-tiny", "--set", "num_layers=2"]


@needs_devices(4)
def test_cli_verify_float16_against_float32(tmp_path, capsys):
    out = tmp_path / "verify.json"
    rc = main(["verify", *LLAMA, "--mesh", "fsdp=2,tensor=2", "--dtype", "float16", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"], result
    assert result["dtype"] == "float16" and result["reference_dtype"] == "float32"
    assert result["grad_tolerance"] == 16 * 2.0**-11
    assert result["max_rel_diff_grads"] > 1e-4  # float16 rounding really shows against float32
    assert "(float16 against float32 on one device)" in capsys.readouterr().out


@needs_devices(4)
def test_verify_float16_catches_underflowed_gradients():
    """Too small a loss scale flushes float16 cotangents to zero: against the float32 reference
    the gradients are wrong, as a float16 reference would not show."""
    from xlaopt.models.registry import get_config
    from xlaopt.runtime.verify import reference_program

    tiny = ExecutionConfig(compute_dtype="float16", loss_scale_init=2.0**-10)
    program = TrainProgram(get_config("llama-tiny", {"num_layers": 2}), MeshSpec.parse("fsdp=2,tensor=2"), execution=tiny)
    sharded, _ = run_pipeline(program, pipeline())
    single, _ = run_pipeline(reference_program(program), pipeline())
    assert single.execution.compute_dtype == "float32"
    result = compare(one_step_grads(sharded), one_step_grads(single), "float16")
    assert not result["ok"] and result["max_rel_diff_grads"] > 0.1, result

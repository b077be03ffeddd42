"""Training a named subset of the parameters, the rest frozen (`TrainSettings.trainable`):
Cosmos 3's generator set, as NVIDIA's vision fine-tuning trains it."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.families import family_of
from xlaopt.mesh import MeshSpec
from xlaopt.models.cosmos3 import GENERATOR_SET
from xlaopt.models.flops import forward_flops_by_tower
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.runtime.verify import compare, one_step_grads
from xlaopt.step import abstract_batch, abstract_params_with_axes, build_grad_fn, trained_part
from xlaopt.transforms.hierarchical_grads import path_name

from conftest import COSMOS3_TINY, LLAMA_TINY, needs_devices

BATCH = BatchShape(4, 48, 96)
FP32 = ExecutionConfig(compute_dtype="float32")


def _program(trainable: str, mesh: str = "") -> TrainProgram:
    program = TrainProgram(COSMOS3_TINY, MeshSpec.parse(mesh) if mesh else MeshSpec(),
                           settings=TrainSettings(batch=BATCH, trainable=trainable), execution=FP32)
    return run_pipeline(program, pipeline())[0]


def _paths(tree) -> dict:
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _generator(path: str) -> bool:
    return (path + "/").startswith(GENERATOR_SET)


def test_the_trained_gradients_are_those_of_training_everything_and_the_reasoner_runs_no_backward():
    frozen, everything = one_step_grads(_program("generator")), one_step_grads(_program("all"))
    assert set(_paths(frozen[1])) == {p for p in _paths(everything[1]) if _generator(p)}
    assert compare(frozen, (everything[0], trained_part(_program("generator"), everything[1])), "float32")["ok"]

    def dots(program):
        params, _ = abstract_params_with_axes(program)
        jaxpr = jax.make_jaxpr(build_grad_fn(program))(params, abstract_batch(program), jax.random.key(0))
        return _count_dots(jaxpr.jaxpr)

    # Left out with the reasoner frozen, in the layer scan's body and after it: each of the
    # reasoner's seven projections (q, k, v, o, gate, up, down) its two backward matmuls (input
    # and weight gradients), its dense attention's four (through softmax(QK^T) V), and the LM
    # head's two. The generator's attention still differentiates the reasoner's keys and values.
    assert dots(_program("all")) - dots(_program("generator")) == 7 * 2 + 4 + 2


def _count_dots(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count_dots(inner)
    return total


def test_model_flops_leave_out_the_frozen_towers_backward():
    """MFU's model FLOPs: the whole forward, and the backward of the generator's part only."""
    batch = family_of(COSMOS3_TINY).synthetic(COSMOS3_TINY, BATCH, 0).batch(0)
    family = family_of(COSMOS3_TINY)
    everything, frozen = family.step_flops(_program("all"), batch), family.step_flops(_program("generator"), batch)
    reasoner = generator = 0.0
    for text, gen in zip(batch["text_segment_ids_BT"], batch["gen_segment_ids_BV"]):
        n = int(max(text.max(), gen.max())) + 1
        r, g = forward_flops_by_tower(COSMOS3_TINY, np.bincount(text, minlength=n)[1:],
                                      np.bincount(gen, minlength=n)[1:])
        reasoner, generator = reasoner + float(r.sum()), generator + float(g.sum())
    assert reasoner > 0 and generator > 0
    # Video-only rows here: every generator token is noisy video, as the defaults assume.
    assert everything == pytest.approx(3 * (reasoner + generator), rel=0.02)
    assert frozen == pytest.approx(reasoner + 3 * generator, rel=0.02)
    assert everything - frozen == pytest.approx(2 * reasoner, rel=1e-9)


@pytest.mark.parametrize("config, name, message", [
    (COSMOS3_TINY, "reasoner", "trainable='reasoner': the cosmos3 family's parameter sets are all, generator"),
    (LLAMA_TINY, "generator", "trainable='generator': the decoder family's parameter sets are all"),
])
def test_an_unknown_set_names_the_familys_sets(config, name, message):
    with pytest.raises(UserError, match=message):
        TrainProgram(config, settings=dataclasses.replace(TrainSettings(), trainable=name))


def test_a_resume_may_train_less_than_its_checkpoint_not_more():
    from xlaopt.checkpoint.layout import CheckpointError
    from xlaopt.runtime.train import _check_same_run, _run_meta

    frozen, everything = (json.loads(json.dumps(_run_meta(_program(t), None))) for t in ("generator", "all"))
    _check_same_run(frozen, _program("generator"), "ckpt")
    _check_same_run(everything, _program("generator"), "ckpt")  # fine-tuning part of a trained model
    with pytest.raises(CheckpointError, match="saved by a run training 'generator' parameters, this run trains 'all'"
                                              ".* Resume with --trainable generator"):
        _check_same_run(frozen, _program("all"), "ckpt")
    del everything["trainable"]  # a checkpoint from before the setting trained everything
    _check_same_run(everything, _program("generator"), "ckpt")


def test_fine_tuning_the_generator_resumes_from_a_checkpoint_that_trained_everything(tmp_path):
    """What an imported model's fine-tuning does: every parameter and the generator's moments
    restored, the reasoner's moments left behind, and the reasoner then stays as it was saved."""
    from xlaopt.checkpoint.layout import read_manifest, step_dir_name
    from xlaopt.checkpoint.restore import read_all
    from xlaopt.cli import main

    common = ["train", "--model", "cosmos3-tiny", "--set", "num_layers=1", "--batch-size", "4", "--no-progress",
              "--ckpt", str(tmp_path)]
    assert main([*common, "--steps", "2", "--ckpt-every", "1"]) == 0
    assert main([*common, "--steps", "3", "--ckpt-every", "1", "--resume", "--trainable", "generator"]) == 0
    read = lambda step: read_all(tmp_path / step_dir_name(step), read_manifest(tmp_path / step_dir_name(step)))  # noqa: E731
    before, after = read(2), read(3)
    reasoner = [n for n in before if n.startswith("params/") and not _generator(n[len("params/"):])]
    assert reasoner and all(np.array_equal(before[n], after[n]) for n in reasoner)
    assert not any(np.array_equal(before[n], after[n]) for n in before if n.startswith("params/layers/generator/")
                   and before[n].ndim > 1)
    # AdamW's moments of the generator's parameters only, and its counts.
    moment_of = lambda n: next((n.split(m, 1)[1] for m in ("/mu/", "/nu/") if m in n), None)  # noqa: E731
    saved = {n for n in before if n.startswith("opt_state/")}
    assert {n for n in after if n.startswith("opt_state/")} == {
        n for n in saved if moment_of(n) is None or _generator(moment_of(n))} != saved


@needs_devices(8)
def test_frozen_training_through_the_gradient_passes_equals_one_device():
    """Hierarchical gradient sync hooks each layer's parameter gradients inside the backward loop;
    with the reasoner's left out it still reduces the generator's and matches one device."""
    from xlaopt.analysis.topology import parse_topology

    from conftest import check_pass

    program = TrainProgram(COSMOS3_TINY, MeshSpec.parse("data=4,tensor=2"), settings=TrainSettings(trainable="generator"),
                           execution=dataclasses.replace(FP32, remat="full"))
    _, records = check_pass(program, parse_topology("h100:2x4"))
    assert records["hierarchical-grads"].changed


def test_the_analytic_price_drops_the_frozen_backward_and_state():
    """The planner's price of a frozen reasoner: fp32 weights only for what is frozen, the backward
    on the trained share (all of it frozen: the step is its forward), the optimizer and gradient
    sync over the trained parameters."""
    from xlaopt.analysis import analytic, costmodel as cm
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.models.registry import get_config
    from xlaopt.planning.price import analytic_layout, price, software
    from xlaopt.planning.shapes import analytic_shape
    from xlaopt.planning.space import Candidate

    config, h100 = get_config("cosmos3-nano"), parse_topology("h100:1x8")
    batch, candidate = BatchShape(8, 1024, 8192), Candidate(1, 8, 1, 1, "full")
    shapes = {t: analytic_shape(config, 4.0e7, 1 / 9, t, 0.05) for t in ("all", "generator")}
    everything, frozen = (price(candidate, shapes[t], batch, h100, "gpu", False) for t in ("all", "generator"))
    shape = shapes["generator"]
    trained = shape.layers * shape.layer_params / 2  # one tower of two; the embedding and head frozen
    assert frozen.memory_parts["state"] == pytest.approx((4 * shape.params + 8 * trained) / 8)
    assert frozen.memory_parts["gradients"] == pytest.approx(4 * trained / 8)
    assert everything.memory_parts["state"] == pytest.approx(12 * shape.params / 8)
    assert frozen.breakdown.optimizer_s == pytest.approx(everything.breakdown.optimizer_s * trained / shape.params)
    assert frozen.breakdown.compute_s < everything.breakdown.compute_s
    assert frozen.breakdown.fsdp_exposed_s <= everything.breakdown.fsdp_exposed_s

    # Nothing trained: the step's compute is the forward of every layer and of the head.
    nothing = dataclasses.replace(shape, frozen_tokens=1.0, frozen_attention=1.0)
    layout, sw = analytic_layout(candidate, batch), software(candidate, "gpu", shape.heads, shape.kv_heads)
    forward = analytic._layer(shape, layout, h100, sw, cm.FITTED).fwd_s
    head = analytic._head_s(analytic._layer(shape, layout, h100, sw, cm.FITTED), shape, layout, h100, cm.FITTED)
    assert analytic.price_step(nothing, layout, h100, sw, cm.FITTED).compute_s == pytest.approx(
        layout.micro_batches * (shape.layers * forward + head))


def test_the_planner_plans_a_frozen_reasoner_from_its_rows():
    """`plan --trainable generator` end to end: the shape the planner prices from the rows freezes
    the text tokens, their share of the attention, one tower of two and the head."""
    from xlaopt.analysis.priced_batch import synthetic_batch
    from xlaopt.analysis.topology import parse_topology
    from xlaopt.build import build_program
    from xlaopt.planning.planner import plan

    best = {}
    for trainable in ("all", "generator"):
        program = build_program(COSMOS3_TINY, batch=BatchShape(8, 48, 96), target="gpu", trainable=trainable,
                                execution=ExecutionConfig(attention="cudnn"))
        result = plan(program, parse_topology("h100:1x8"), synthetic_batch(program), top=0, remats=("full",),
                      precisions=("bfloat16",), stages=(1,))
        best[trainable] = {p.candidate: p.analytic for p in result.ranked}
    shared = set(best["all"]) & set(best["generator"])
    assert shared and all(best["generator"][c].memory_parts["state"] < best["all"][c].memory_parts["state"]
                          and best["generator"][c].breakdown.compute_s < best["all"][c].breakdown.compute_s
                          for c in shared)

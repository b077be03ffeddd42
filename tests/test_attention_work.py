"""The price follows the executed work: the pairs the mask needs, counted exactly; segment-aware
attention's pair loops priced by the trip counts of the priced batch, exactly as many times as
their bodies' FLOPs; the analysis reports fill and the work ratios."""
import dataclasses
import math

import numpy as np
import pytest

from xlaopt.analysis.analyze import analyze
from xlaopt.analysis.attention_work import batch_work, needed_pairs
from xlaopt.analysis.priced_batch import PricedBatch, cosmos3_layout
from xlaopt.analysis.schedule import Op, build_schedule
from xlaopt.analysis.simulate import compute_time_s
from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.data.batch import BatchShape
from xlaopt.families import family_of
from xlaopt.mesh import MeshSpec
from xlaopt.models.masks import pair_mask
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings

from conftest import needs_devices

BLOCK = 16


def test_needed_pairs_count_what_the_mask_allows_between_real_tokens(tiny_config, synthetic_batch):
    for q, k in family_of(tiny_config).attention_calls(synthetic_batch):
        allowed = np.asarray(pair_mask(q, k)) & (np.asarray(q.segment_BL) > 0)[:, :, None]
        np.testing.assert_array_equal(needed_pairs(q, k), allowed.sum(axis=(1, 2)))


def test_layout_of_planned_rows_matches_the_packers_and_its_flops():
    """Rows given as (n_text, n_gen, modality, n_clean) lay out as `fill_row` lays samples out."""
    shape = BatchShape(2, 16, 32)
    rows = [[(5, 10, 1, 4), (3, 0, 0, 0), (4, 20, 1, 0)], [(16, 32, 1, 0)]]
    arrays = cosmos3_layout(shape, rows)
    np.testing.assert_array_equal(arrays["text_segment_ids_BT"][0], [1] * 5 + [2] * 3 + [3] * 4 + [0] * 4)
    np.testing.assert_array_equal(arrays["gen_segment_ids_BV"][0], [1] * 10 + [3] * 20 + [0] * 2)
    assert arrays["gen_noisy_BV"][0].sum() == 6 + 20 and not arrays["gen_noisy_BV"][0, :4].any()
    with pytest.raises(ValueError, match="row 1"):
        cosmos3_layout(shape, [rows[0], [(17, 0, 0, 0)]])


def test_a_repeated_op_costs_its_runs():
    op = Op("dot", "fusion", "compute", "body", 0, flops=3e8, bytes=10**6, matmuls=(3e8,), dtype="bf16")
    topology = parse_topology("h100:1x8")
    ten = dataclasses.replace(op, flops=op.flops * 10, bytes=op.bytes * 10, repeat=10)
    assert compute_time_s(ten, topology) == pytest.approx(10 * compute_time_s(op, topology), rel=1e-12)


@pytest.fixture(scope="module")
def segment_program(tiny_config):
    program = TrainProgram(tiny_config, MeshSpec.parse("fsdp=2"), settings=TrainSettings(batch=BatchShape(2, 48, 96)))
    program = dataclasses.replace(program, execution=dataclasses.replace(program.execution, attention="segment",
                                                                        attention_block=BLOCK))
    return run_pipeline(program, pipeline())[0]


@needs_devices(2)
def test_pair_loops_are_priced_by_the_given_trips_as_often_as_their_bodies(segment_program, tiny_config):
    """Doubling every pair loop's trip count adds exactly one more batch of pairs' matmuls: per
    pair and layer, 2 forward and 5 backward matmuls of 2 * block^2 * heads * head_dim FLOPs."""
    text = compile_program(segment_program).train_step.as_text()
    trips = {"xlaopt_pairs_L48_S48": 3, "xlaopt_pairs_L96_S144": 7}
    once, twice = build_schedule(text, trips), build_schedule(text, {t: 2 * n for t, n in trips.items()})
    given = [loop for loop in once.loops if loop["given"]]
    assert sorted({loop["trip_count"] for loop in given}) == [3, 7] and len(given) == 4  # forward and backward
    c = tiny_config
    per_pair = 7 * 2 * BLOCK * BLOCK * c.num_heads * c.head_dim * c.num_layers
    assert twice.flops - once.flops == pytest.approx(sum(trips.values()) * per_pair, rel=1e-9)


@needs_devices(2)
def test_analysis_reports_fill_and_work_ratios_of_the_priced_rows(segment_program):
    """Rows of whole block-aligned samples: segment-aware attention executes exactly the blocks of
    each sample; the analysis prices the busiest device's share and reports it."""
    shape = segment_program.settings.batch
    rows = [[(16, 32, 1, 0), (16, 32, 1, 0), (16, 32, 1, 0)], [(16, 48, 1, 0), (32, 48, 1, 0)]]
    batch = PricedBatch("two rows", shape, cosmos3_layout(shape, rows))
    work = batch_work(segment_program, batch.arrays)
    # Row 0: text blocks 1 each (3), generator 6 blocks x (1 text + 2 gen) (18). Row 1: text 1 + 3
    # (the second sample's 2 blocks, causally), generator 3 x (1 + 3) + 3 x (2 + 3) = 27. One row
    # per device (fsdp=2): the busiest device's counts.
    assert work.loop_trips == {"xlaopt_pairs_L48_S48": 4, "xlaopt_pairs_L96_S144": 27}
    assert work.mean_loop_trips == {"xlaopt_pairs_L48_S48": 3.5, "xlaopt_pairs_L96_S144": 22.5}
    assert work.fill == 1.0
    result = analyze(segment_program, parse_topology("h100:1x8"), "cpu", batch=batch)
    assert result["fill"] == 1.0 and result["data"] == "two rows"
    executed = (3 + 18 + 4 + 27) * BLOCK * BLOCK
    assert result["attention"]["pairs_executed_per_layer"] == executed
    assert result["attention_pairs_executed_over_needed"] == pytest.approx(executed / work.pairs_needed)
    assert result["hlo_flops_over_model_flops"] == pytest.approx(
        result["hlo_matmul_flops_per_step"] / result["model_flops_per_step"])
    dense = analyze(dataclasses.replace(segment_program, execution=dataclasses.replace(
        segment_program.execution, attention="dense")), parse_topology("h100:1x8"), "cpu", batch=batch)
    assert dense["attention_pairs_executed_over_needed"] > result["attention_pairs_executed_over_needed"]
    assert math.isfinite(result["step_time_s"]) and result["step_time_s"] > 0


def test_a_pipelines_attention_runs_are_counted_per_stage_and_micro_batch():
    """Under a pipeline one run of a layer's attention is one stage's pass over one of the
    pipeline's micro-batches: a data rank's rows cut into them, not the rows the rule table leaves
    a stage. Segment attention's pair-loop trips here; cuDNN's fused-call FLOPs come from the same
    per-run rows (`_per_device_trips`; the GPU-target calibration test checks their values)."""
    from xlaopt.analysis.priced_batch import whole_rows_batch
    from xlaopt.data.batch import BatchShape
    from xlaopt.execution import ExecutionConfig
    from xlaopt.mesh import MeshSpec
    from xlaopt.models.registry import get_config
    from xlaopt.models.segment_attention import loop_tag
    from xlaopt.pipeline import pipeline, run_pipeline, select_passes
    from xlaopt.program import TrainProgram, TrainSettings

    trips = {}
    for label, mesh, execution in (("scan", "data=2", {}),
                                   ("pipeline", "stage=2,data=2", dict(layer_stack="pipeline", pipeline_microbatches=4))):
        program = TrainProgram(get_config("llama-tiny"), MeshSpec.parse(mesh), target="gpu",
                               settings=TrainSettings(batch=BatchShape(16, 64, 0)),
                               execution=ExecutionConfig(attention="segment", attention_block=16, **execution))
        program, _ = run_pipeline(program, select_passes(pipeline(), ["mesh-layout"]))
        work = batch_work(program, whole_rows_batch(program).arrays)
        trips[label] = (work.loop_trips[loop_tag(64, 64)], work.mean_loop_trips[loop_tag(64, 64)])
    causal_blocks = 4 * 5 // 2  # one document per row of 4 blocks
    # data=2: 8 rows a run; a pipeline's data rank cuts its 8 rows into 4 micro-batches of 2
    assert trips == {"scan": (8 * causal_blocks, 8 * causal_blocks), "pipeline": (2 * causal_blocks, 2 * causal_blocks)}

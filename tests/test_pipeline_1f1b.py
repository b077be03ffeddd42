"""The 1F1B pipeline schedule (`pipeline_schedule=1f1b`, `xlaopt.models.pipeline_1f1b`): its
arithmetic, its loop against the unpipelined loss and gradients of a small stack, the activations
a stage keeps, and the compiled decoder step's sends, loop and price. The decoder's steps equal to
one device's are in test_pipeline_parallel.py's CASES."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from xlaopt.analysis.analyze import analyze, format_analysis
from xlaopt.analysis.hlo import collectives
from xlaopt.analysis.schedule import build_schedule
from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.mesh import MeshSpec
from xlaopt.models.layers import rows_split_over
from xlaopt.models.pipeline import PipelineSchedule
from xlaopt.models.pipeline_1f1b import pipeline_loss_1f1b
from xlaopt.models.stack import scan_layers
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings

from conftest import needs_devices


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 4)])
def test_each_microbatch_runs_forward_then_backward_and_a_stage_keeps_at_most_2p_minus_1(stages, microbatches):
    """Micro-batch m's forward on stage p at tick m + p, its backward at m + 2P - 2 - p: each
    stage runs every forward and every backward once, a backward after its forward and after the
    next stage's backward of it; stage p keeps 2(P - 1 - p) + 1 at most, min(M, 2P - 1) on stage
    0 (GPipe: every tick's); the busiest stage's work per tick runs forwards alone for P - 1
    ticks and backwards alone for the last P - 1, so the bubble is GPipe's."""
    P, M = stages, microbatches
    s = PipelineSchedule(P, M, "1f1b")
    assert s.ticks == M + 2 * P - 2
    fwd = {(p, t): t - p for p in range(P) for t in range(s.ticks) if 0 <= t - p < M}
    bwd = {(p, t): t - (2 * P - 2 - p) for p in range(P) for t in range(s.ticks) if 0 <= t - (2 * P - 2 - p) < M}
    for p in range(P):
        assert sorted(m for (q, _), m in fwd.items() if q == p) == list(range(M))
        assert sorted(m for (q, _), m in bwd.items() if q == p) == list(range(M))
        for m in range(M):
            f = next(t for (q, t), n in fwd.items() if (q, n) == (p, m))
            b = next(t for (q, t), n in bwd.items() if (q, n) == (p, m))
            assert b >= f and (p == P - 1 or b == 1 + next(t for (q, t), n in bwd.items() if (q, n) == (p + 1, m)))
    held = max(sum(1 for m in range(M) if m + 0 <= t <= m + 2 * P - 2) for t in range(s.ticks))
    assert held == s.saved_ticks == min(M, 2 * P - 1) < PipelineSchedule(P, M).saved_ticks
    for t in range(s.ticks):
        assert s.taken_at(t) == {"forward": any((p, t) in fwd for p in range(P)),
                                 "tail": (P - 1, t) in fwd, "backward": any((p, t) in bwd for p in range(P))}
    assert s.bubble_fraction == PipelineSchedule(P, M).bubble_fraction == (P - 1) / (M + P - 1)
    with pytest.raises(ValueError, match="interleaved 1F1B, not built yet"):
        PipelineSchedule(P, M, "1f1b", virtual_stages=2)


L, B, T, D = 8, 16, 2, 6


def _layer(w_DD, x_BTD, s_BTD, ids_BT):
    return jnp.tanh(x_BTD @ w_DD + s_BTD * (ids_BT[..., None] + 1) * 0.1) + 0.5 * x_BTD


def _tail(head_DC, y_BTD, targets_BT, scale):
    logits = y_BTD @ head_DC
    nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets_BT[..., None], -1)) * scale
    return nll, {"logits": jnp.sum(logits) * scale}  # a metric: reported, not differentiated


@needs_devices(8)
@pytest.mark.parametrize("mesh,microbatches", [("stage=4,data=2", 8), ("stage=2,data=2,fsdp=2", 4)])
def test_the_loop_gives_the_unpipelined_loss_and_gradients_and_keeps_2p_minus_1_slots(mesh, microbatches):
    """A stack of 8 small layers (a float and an integer argument beside the carry) and a tail:
    the 1F1B loop's loss, a metric the tail reports, and the gradients (weights, tail, carry,
    float argument) equal the unpipelined ones; its one tick loop of M + 2P - 2 trips keeps each residual in min(M, 2P - 1)
    slots, never one per micro-batch or per tick."""
    sizes = dict((a, int(n)) for a, n in (kv.split("=") for kv in mesh.split(",")))
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    w, head, x, s = normal(L, D, D) * 0.5, normal(D, 3), normal(B, T, D), normal(B, T, D)
    ids, targets = (jnp.asarray(rng.integers(0, 3, size=(B, T)), jnp.int32) for _ in range(2))

    def unpipelined(w, head, x, s):
        return _tail(head, scan_layers(_layer, w, x, (s, ids)), targets, 1.0 / B)

    def pipelined(w, head, x, s):
        with rows_split_over(tuple(a for a in sizes if a != "stage") + ("stage",)):
            return pipeline_loss_1f1b(_layer, w, x, (s, ids), _tail, head, targets, jnp.float32(1.0 / B),
                                      microbatches, inner=scan_layers)

    want = jax.value_and_grad(unpipelined, argnums=(0, 1, 2, 3), has_aux=True)(w, head, x, s)
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
    with jax.set_mesh(mesh):
        w = jax.device_put(w, NamedSharding(mesh, PartitionSpec("stage")))
        step = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1, 2, 3), has_aux=True))
        got, text = step(w, head, x, s), step.lower(w, head, x, s).compile().as_text()
    (loss, metrics), (want_loss, want_metrics) = got[0], want[0]
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert float(metrics["logits"]) == pytest.approx(float(want_metrics["logits"]), rel=1e-5)
    for name, a, b in zip(("weights", "tail", "carry", "argument"), want[1], got[1]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=name)

    P = sizes["stage"]
    schedule = PipelineSchedule(P, microbatches, "1f1b")
    rows = B // sizes.get("data", 1) // microbatches  # per micro-batch on a data rank
    saved = f"f32[{schedule.saved_ticks},{L // P},{rows},{T},{D}]"  # [slots, a stage's layers, rows, T, D]
    states = [m.group(1) for m in re.finditer(r"= \(([^)]*)\) while\(", text)]
    ticking = [st for st in states if f"s32[{schedule.ticks}]" in st]
    assert len(ticking) == 1 and saved in ticking[0], ticking
    assert not any(f"f32[{n},{L // P},{rows},{T},{D}]" in st for st in states for n in (microbatches, schedule.ticks))


@needs_devices(8)
def test_the_compiled_decoder_step_sends_both_ways_each_tick_and_prices_the_busiest_stage():
    """llama-tiny (4 layers) on stage=2,fsdp=2,tensor=2 with 1F1B, 4 micro-batches, each stage's
    weights gathered once (test_pipeline_parallel.py's case, which equals one device): over
    `stage` one send up and one down per tick, M + 2P - 2 = 6 ticks, in one tick loop; analyze
    states the schedule and prices each tick's branches by what the busiest stage runs, so the
    loop costs less than six forwards and backwards."""
    from test_pipeline_parallel import CASES

    config, mesh, batch, execution, _, _ = CASES["llama-1f1b-fsdp-tensor-weights-once"]
    program = TrainProgram(config, MeshSpec.parse(mesh), settings=TrainSettings(batch=batch), execution=execution)
    laid, _ = run_pipeline(program, pipeline())
    schedule = program.pipeline_schedule
    assert (schedule.name, schedule.ticks, schedule.saved_ticks) == ("1f1b", 6, 3)
    sends = [c for c in collectives(compile_program(laid).train_step.as_text(), laid.mesh.as_dict())
             if c.mesh_axes == ("stage",) and c.kind == "collective-permute"]
    assert sorted(c.executions for c in sends) == [6, 6], [(c.name, c.executions) for c in sends]
    up, down = sorted(sends, key=lambda c: c.replica_groups[0][0] > c.replica_groups[0][1])  # (source, target)s
    assert all(a < b for a, b in up.replica_groups) and {(b, a) for a, b in up.replica_groups} == \
        {tuple(pair) for pair in down.replica_groups}

    text = compile_program(laid).train_step.as_text()
    result = analyze(laid, parse_topology("cpu:1x8"))
    p = result["pipeline"]
    assert len(p["tick_loops"]) == 1 and p["bubble_s"] == pytest.approx(p["tick_loops_s"] / 5)
    assert ("pipeline: 1f1b, 2 stages x 4 micro-batches: 6 ticks, the bubble 20.0% of each device's time; a stage "
            "holds at most 3 ticks' activations") in format_analysis(result)

    # Priced tick by tick: of the 6 ticks, the forward runs on the first 5 (some stage has one),
    # the tail (loss, last stage) on ticks 1-4, the backward on the last 5. Each branch's FLOPs
    # alone, from schedules taking only it at every tick, add up to the step's.
    rules = schedule.branches_taken()
    flops = lambda taken: build_schedule(text, branch_taken=taken).flops  # noqa: E731
    none = flops({scope: lambda t: False for scope in rules})
    part = {scope.split("_")[-1]: (flops({s: (lambda t, on=s == scope: on) for s in rules}) - none) / 6
            for scope in rules}
    assert all(v > 0 for v in part.values()), part
    assert flops(rules) == pytest.approx(none + 5 * part["forward"] + 4 * part["tail"] + 5 * part["backward"])
    assert flops(rules) < build_schedule(text).flops  # the heaviest branch at every tick

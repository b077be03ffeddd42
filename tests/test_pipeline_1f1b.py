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
from xlaopt.transforms.layers_apart import apart, is_layers

from conftest import needs_devices


@pytest.mark.parametrize("stages,microbatches,virtual", [(2, 4, 1), (4, 8, 1), (4, 4, 1), (2, 4, 2), (4, 8, 3)])
def test_each_microbatch_runs_forward_then_backward_and_a_stage_keeps_at_most_2p_minus_1(stages, microbatches,
                                                                                           virtual):
    """Every stage runs every (micro-batch, round)'s forward and backward once. A forward follows
    the previous stage's forward of it a tick later (the last stage's previous round, round the
    ring); a backward follows the next stage's backward of it (the first stage's next round), and
    the last round's starts on the last stage in the tick of its forward, after the tail. Without
    virtual stages: micro-batch m forward on stage p at tick m + p, backward at m + 2P - 2 - p,
    at most min(M, 2P - 1) held, GPipe's every tick. Over V rounds: (V + 1) P - 1 chunks held at
    most, within the ring's 2VP - 1 slots. The busiest stage's work per tick runs forwards alone
    for VP - 1 ticks and backwards alone for the last VP - 1, so the bubble is GPipe's over as
    many virtual stages."""
    P, M, V = stages, microbatches, virtual
    s = PipelineSchedule(P, M, "1f1b", V)
    assert s.ticks == V * M + V * P + P - 2
    fwd = {(p, *s.forward_at(p, t)): t for p in range(P) for t in range(s.ticks) if s.forward_at(p, t)}
    bwd = {(p, *s.backward_at(p, t)): t for p in range(P) for t in range(s.ticks) if s.backward_at(p, t)}
    assert sorted(fwd) == sorted(bwd) == [(p, m, v) for p in range(P) for m in range(M) for v in range(V)]
    for (p, m, v), t in fwd.items():
        before = (p - 1, m, v) if p else (P - 1, m, v - 1) if v else None
        assert before is None or fwd[before] == t - 1
        if V == 1:
            assert (t, bwd[p, m, v]) == (m + p, m + 2 * P - 2 - p)
    for (p, m, v), t in bwd.items():
        after = (p + 1, m, v) if p < P - 1 else (0, m, v + 1) if v < V - 1 else None
        assert bwd[after] == t - 1 if after else t == fwd[p, m, v]
        # the slot a backward reads: the unit its forward wrote (forward unit i at tick i + p)
        assert s.backward_unit(t - s.backward_lag(p)) == (m, v, fwd[p, m, v] - p)
    held = max(sum(1 for (q, m, v), f in fwd.items() if q == p and f <= t <= bwd[q, m, v])
               for p in range(P) for t in range(s.ticks))
    assert held == (min(M, 2 * P - 1) if V == 1 else (V + 1) * P - 1)
    assert held <= s.saved_ticks == min(V * M, 2 * V * P - 1) < PipelineSchedule(P, M, virtual_stages=V).saved_ticks
    for t in range(s.ticks):
        assert s.taken_at(t) == {"forward": any(f == t for f in fwd.values()),
                                 "tail": any(f == t and (p, v) == (P - 1, V - 1) for (p, _, v), f in fwd.items()),
                                 "backward": any(b == t for b in bwd.values())}
    assert s.bubble_fraction == PipelineSchedule(P, M, virtual_stages=V).bubble_fraction == (P - 1) / (V * M + P - 1)


L, B, T, D = 8, 16, 2, 6


def _layer(w_DD, x_BTD, s_BTD, ids_BT):
    return jnp.tanh(x_BTD @ w_DD + s_BTD * (ids_BT[..., None] + 1) * 0.1) + 0.5 * x_BTD


def _tail(head_DC, y_BTD, targets_BT, scale):
    logits = y_BTD @ head_DC
    nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets_BT[..., None], -1)) * scale
    return nll, {"logits": jnp.sum(logits) * scale}  # a metric: reported, not differentiated


@needs_devices(8)
@pytest.mark.parametrize("mesh,microbatches,virtual", [("stage=4,data=2", 8, 1), ("stage=2,data=2,fsdp=2", 4, 2)])
def test_the_loop_gives_the_unpipelined_loss_and_gradients_and_keeps_2p_minus_1_slots(mesh, microbatches, virtual):
    """A stack of 8 small layers (a float and an integer argument beside the carry) and a tail:
    the 1F1B loop's loss, a metric the tail reports, and the gradients (weights, tail, carry,
    float argument) equal the unpipelined ones, without virtual stages and over two (interleaved
    1F1B: chunks of 2 layers, the weights reordered into round order and their gradients back).
    Its one tick loop of V M + VP + P - 2 trips keeps each residual of a chunk in min(V M, 2VP - 1)
    slots (2P - 1 without virtual stages) and a spare, never one per micro-batch or per tick. Over
    virtual stages a tick runs its chunk's layers unrolled, each on its own buffers
    (`layers_apart`): the tick loop holds no loop; without them the stage's layer scan, forward
    and backward, is a loop inside it."""
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
                                      microbatches, inner=scan_layers, virtual_stages=virtual)

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
    schedule, chunk = PipelineSchedule(P, microbatches, "1f1b", virtual), L // P // virtual
    rows = B // sizes.get("data", 1) // microbatches  # per micro-batch on a data rank
    # [slots and a spare for the bubble's writes, a chunk's layers, rows, T, D]: the only
    # residual buffers, in the one tick loop and in no other loop
    saved = rf"f32\[(\d+),{chunk},{rows},{T},{D}\]"
    states = [m.group(1) for m in re.finditer(r"= \(([^)]*)\) while\(", text)]
    ticking = [st for st in states if f"s32[{schedule.ticks}]" in st]
    assert len(ticking) == 1 and {int(n) for n in re.findall(saved, ticking[0])} == {schedule.saved_ticks + 1}, \
        ticking
    assert not any(re.search(saved, st) for st in states if st is not ticking[0])
    assert len(states) == (1 if virtual > 1 else 3), len(states)


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
    # The bubble: P - 1 of M + P - 1 stage times of the loop, its tail (4 of them, one a
    # micro-batch, in none of the bubble's ticks) taken out first.
    assert len(p["tick_loops"]) == 1 and 0 < p["tail_s"] < p["tick_loops_s"]
    assert p["bubble_s"] == pytest.approx((p["tick_loops_s"] - p["tail_s"]) / 5)
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


def _walk(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner)


def test_a_ticks_forward_reads_the_weights_cast_once_a_step():
    """A layer that computes in bf16 from fp32 weights (a scan over a chunk's 2 layers, as the
    loop runs a chunk): `_split_on_weights` casts them in `once_of`, once a step, and the
    forward a tick runs reads the casts: it converts no weight-shaped fp32 array, where the
    unsplit forward did at every tick. Its output and the vjp rebuilt from `once` and what the
    forward keeps are the unsplit ones, bit for bit."""
    from xlaopt.models.pipeline_1f1b import _split_on_weights

    def layer(w_DD, x_BTD, s_BTD, ids_BT):
        return _layer(w_DD.astype(jnp.bfloat16), x_BTD, s_BTD.astype(jnp.bfloat16), ids_BT).astype(x_BTD.dtype)

    def fwd(p, x, af, ar):
        return scan_layers(layer, p, x, (af[0], ar[0]))

    rng = np.random.default_rng(1)
    w, x, s = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((2, D, D), (B, T, D), (B, T, D)))
    ids = jnp.asarray(rng.integers(0, 3, size=(B, T)), jnp.int32)
    once_of, forward_of, backward_of, (once_apart, held_apart) = _split_on_weights(fwd, w, x, [s], [ids])
    once, held = once_of(w)
    assert {h.dtype for h in held} == {jnp.dtype(jnp.bfloat16)}  # the casts alone, not the fp32 weights
    assert all(held_apart) and held and any(once_apart)  # the layer scan scans them: each layer's own buffer
    once, held = ([apart(a) if by_layer else a for a, by_layer in zip(tree, which)]
                  for tree, which in ((once, once_apart), (held, held_apart)))
    weight_converts = [e for e in _walk(jax.make_jaxpr(lambda h: forward_of(h, x, [s], [ids]))(held).jaxpr)
                       if e.primitive.name == "convert_element_type" and e.invars[0].aval.dtype == jnp.float32
                       and e.invars[0].aval.shape[-2:] == (D, D)]
    assert weight_converts == []
    unsplit_converts = [e for e in _walk(jax.make_jaxpr(lambda w: fwd(w, x, [s], [ids]))(w).jaxpr)
                        if e.primitive.name == "convert_element_type" and e.invars[0].aval.shape[-2:] == (D, D)]
    assert unsplit_converts  # the check above can fail: the unsplit forward casts the weights

    y, kept = forward_of(held, x, [s], [ids])
    # what the scan keeps, a layer at a time; beside it only what every layer reads of the
    # arguments, computed once before the scan (rows first, no layer dimension)
    assert any(is_layers(k) for k in kept) and all(len(k) == 2 for k in kept if is_layers(k))
    assert all(k.shape[:2] == (B, T) for k in kept if not is_layers(k))
    want_y, want_vjp = jax.vjp(lambda p, x, af: fwd(p, x, af, [ids]), w, x, [s])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    dy = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
    d_w, d_x, d_s = jax.jit(backward_of)(once, kept, dy)
    assert is_layers(d_w) and not is_layers(d_x)  # the weights' gradients a layer at a time, never stacked
    got = jax.tree.map(lambda g: g.stacked() if is_layers(g) else g, (d_w, d_x, d_s), is_leaf=is_layers)
    for a, want in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(want_vjp)(dy)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want))


def _half_layer(p, x_BTD, s_BTD, ids_BT):
    """`_layer` computing in float16 from fp32 weights, beside a scale it reads in fp32 (as a norm
    reads its own)."""
    h = _layer(p["w"].astype(jnp.float16), x_BTD.astype(jnp.float16), s_BTD.astype(jnp.float16), ids_BT)
    return h.astype(jnp.float32) * p["scale"]


@needs_devices(8)
def test_weights_only_cast_run_cast_and_their_gradients_leave_the_backward_narrow():
    """`_narrowed` casts a weight the layer only casts (to float16 here) and leaves one it reads
    in fp32, so the loop's forward and backward run on the cast weight. The loop's loss and
    gradients on stage=2,data=2 (4 micro-batches, 2 virtual stages) equal the unpipelined step's
    in their dtypes, to float16's rounding of each micro-batch's weight gradient, which the
    unpipelined step rounds once as one sum over the batch (2^-11 relative each; rtol 4e-3)."""
    from xlaopt.models.pipeline_1f1b import _narrowed

    rng = np.random.default_rng(2)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    params = {"w": normal(L, D, D) * 0.5, "scale": 1 + 0.1 * normal(L, 1, 1, D)}
    head, x, s = normal(D, 3), normal(B, T, D), normal(B, T, D)
    ids, targets = (jnp.asarray(rng.integers(0, 3, size=(B, T)), jnp.int32) for _ in range(2))

    def fwd(p, x, af, ar):
        return scan_layers(_half_layer, p, x, (af[0], ar[0]))

    chunk = jax.tree.map(lambda a: a[:2], params)
    narrowed = _narrowed(fwd, chunk, x, [s], [ids])(chunk)
    assert (narrowed["w"].dtype, narrowed["scale"].dtype) == (jnp.float16, jnp.float32)

    def unpipelined(p, head, x, s):
        return _tail(head, scan_layers(_half_layer, p, x, (s, ids)), targets, 1.0 / B)

    def pipelined(p, head, x, s):
        with rows_split_over(("data", "stage")):
            return pipeline_loss_1f1b(_half_layer, p, x, (s, ids), _tail, head, targets, jnp.float32(1.0 / B), 4,
                                      inner=scan_layers, virtual_stages=2)

    want = jax.value_and_grad(unpipelined, argnums=(0, 1, 2, 3), has_aux=True)(params, head, x, s)
    mesh = jax.make_mesh((2, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, NamedSharding(mesh, PartitionSpec("stage")))
        got = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1, 2, 3), has_aux=True))(placed, head, x, s)
    assert float(got[0][0]) == pytest.approx(float(want[0][0]), rel=1e-3)
    for name, a, b in zip(("weights", "tail", "carry", "argument"), want[1], got[1]):
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert leaf_b.dtype == leaf_a.dtype, name
            np.testing.assert_allclose(np.asarray(leaf_b), np.asarray(leaf_a), rtol=4e-3, atol=4e-3, err_msg=name)

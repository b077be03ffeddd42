"""The cost-model primitives against their formulas, number for number."""
import dataclasses
import math

import pytest

from xlaopt.analysis import analytic, costmodel as cm
from xlaopt.analysis.analytic import DecoderShape, Parallelism, Software, price_step
from xlaopt.analysis.topology import parse_topology

EFF = cm.Efficiency(matmul_max=0.6, matmul_max_ampere=0.8, matmul_half_flops=1e10, attention=0.3,
                    attention_flash2=0.15, nvlink=0.5, network=0.25)
GB = 1e9


def test_ring_all_gather_inside_a_node_is_n_minus_1_over_n_v_over_w_plus_latency():
    t = parse_topology("h100:1x8")
    nvlink = t.levels[0]
    v = 4 * GB
    expected = 7 * nvlink.latency_s + 7 / 8 * v / (nvlink.bytes_per_s * EFF.nvlink)
    span = cm.group_span(8, 1, 8)
    assert cm.collective_time_s("all-gather", v, span, t, EFF) == pytest.approx(expected, rel=1e-12)
    assert cm.collective_time_s("reduce-scatter", v, span, t, EFF) == pytest.approx(expected, rel=1e-12)
    # A large all-reduce is a reduce-scatter then an all-gather: twice the ring, the ring beats the tree.
    assert cm.collective_time_s("all-reduce", v, span, t, EFF) == pytest.approx(2 * expected, rel=1e-12)


def test_small_all_reduce_takes_the_tree():
    t = parse_topology("h100:1x8")
    nvlink = t.levels[0]
    v = 1024.0
    tree = 2 * 3 * nvlink.latency_s + 2 * v / (nvlink.bytes_per_s * EFF.nvlink)  # log2(8) = 3 levels
    ring = 2 * (7 * nvlink.latency_s + 7 / 8 * v / (nvlink.bytes_per_s * EFF.nvlink))
    assert tree < ring
    assert cm.collective_time_s("all-reduce", v, cm.group_span(8, 1, 8), t, EFF) == pytest.approx(tree, rel=1e-12)


def test_a_group_across_nodes_runs_hierarchically():
    t = parse_topology("h100:4x8")
    nvlink, ib = t.levels
    v = 2 * GB
    span = cm.group_span(32, 1, 8)
    assert (span.per_node, span.nodes) == (8, 4)
    inner = 7 * nvlink.latency_s + 7 / 8 * v / (nvlink.bytes_per_s * EFF.nvlink)
    outer = 3 * ib.latency_s + 3 / 4 * (v / 8) / (ib.bytes_per_s * EFF.network)  # each rail carries V/8
    assert cm.collective_time_s("all-gather", v, span, t, EFF) == pytest.approx(inner + outer, rel=1e-12)
    # One member per node (a data axis outside tensor=8): the whole array crosses the network.
    span1 = cm.group_span(4, 8, 8)
    assert (span1.per_node, span1.nodes) == (1, 4)
    alone = 3 * ib.latency_s + 3 / 4 * v / (ib.bytes_per_s * EFF.network)
    assert cm.collective_time_s("reduce-scatter", v, span1, t, EFF) == pytest.approx(alone, rel=1e-12)
    assert cm.collective_time_s("all-gather", v, span1, t, EFF) > cm.collective_time_s("all-gather", v, span, t, EFF)


@pytest.mark.parametrize("size, stride, per_node, nodes", [
    (1, 1, 1, 1), (8, 1, 8, 1), (16, 1, 8, 2), (4, 2, 4, 1), (8, 2, 4, 2), (4, 8, 1, 4), (64, 1, 64, 1),
])
def test_group_span(size, stride, per_node, nodes):
    devices_per_node = 72 if size == 64 else 8
    assert cm.group_span(size, stride, devices_per_node) == cm.GroupSpan(per_node, nodes)


def test_point_to_point_send_and_degenerate_groups():
    ib = parse_topology("h100:2x8").levels[1]
    assert cm.send_time_s(1 * GB, ib, 0.5) == pytest.approx(ib.latency_s + GB / (ib.bytes_per_s * 0.5), rel=1e-12)
    assert cm.send_time_s(0, ib, 0.5) == 0.0
    assert cm.collective_time_s("all-gather", GB, cm.GroupSpan(1, 1), parse_topology("h100:2x8"), EFF) == 0.0
    with pytest.raises(ValueError, match="collective kind 'all-to-all'"):
        cm.ring_time_s("all-to-all", GB, 8, ib, 1.0)


def test_roofline_and_matmul_efficiency_curve():
    # Compute-bound: 1 TFLOP at 1 PFLOP/s (1 ms) beats 0.5 GB at 1 TB/s (0.5 ms); memory-bound the other way.
    assert cm.roofline_time_s(1e12, 0.5e9, 1e15, 1e12) == pytest.approx(1e-3)
    assert cm.roofline_time_s(1e11, 2e9, 1e15, 1e12) == pytest.approx(2e-3)
    assert cm.memory_time_s(3e9, 3e12) == pytest.approx(1e-3)
    # Half the maximum at matmul_half_flops, approaching the maximum for large matmuls.
    assert cm.matmul_efficiency(1e10, 0.6, 1e10) == pytest.approx(0.3)
    assert cm.matmul_efficiency(1e14, 0.6, 1e10) == pytest.approx(0.6, rel=1e-3)
    assert cm.matmul_time_s(2e12, 1e15, 1e10, 0.6, 1e10) == pytest.approx(2e12 / (1e15 * 0.3))
    assert cm.attention_time_s(1e12, 1e15, EFF) == pytest.approx(1e12 / (1e15 * 0.3))
    assert EFF.matmul_max_for("A100 SXM 80GB") == 0.8 and EFF.matmul_max_for("H100 SXM") == 0.6


def test_an_attention_kernel_has_its_own_fraction_on_hopper_and_newer():
    assert EFF.attention_for("flash2", "H100-SXM-80GB").attention == EFF.attention_flash2
    assert EFF.attention_for("flash2", "B200").attention == EFF.attention_flash2
    assert EFF.attention_for("flash2", "A100-SXM4-80GB") == EFF  # its native kernel there
    assert EFF.attention_for("cudnn", "H100-SXM-80GB") == EFF
    with pytest.raises(ValueError, match="attention kernel 'flash3'; use one of cudnn, flash2"):
        EFF.attention_for("flash3", "H100-SXM-80GB")


def test_efficiencies_must_be_fractions():
    with pytest.raises(ValueError, match="nvlink=1.5 must be in"):
        cm.Efficiency(matmul_max=0.6, matmul_max_ampere=0.8, matmul_half_flops=1e10, attention=0.3,
                      attention_flash2=0.15, nvlink=1.5, network=0.5)
    for name in ("matmul_max", "matmul_max_ampere", "attention", "attention_flash2", "nvlink", "network"):
        assert 0 < getattr(cm.FITTED, name) <= 1


LLAMA8B = DecoderShape(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)


def test_decoder_shape_counts_the_flops_of_the_decoder_model():
    from xlaopt.models.decoder import forward_flops
    from xlaopt.models.registry import get_config

    n = 8192
    assert LLAMA8B.model_flops_per_token(n) == pytest.approx(3 * float(forward_flops(get_config("llama3-8b"), n)) / n,
                                                             rel=1e-12)
    assert LLAMA8B.params == pytest.approx(8.03e9, rel=0.01)  # Llama 3 8B


def test_pipeline_bubble_is_pp_minus_1_over_v_stage_times():
    t = parse_topology("h100:8x8")
    layout = Parallelism(dp=2, fsdp=0, tp=4, pp=8, cp=1, global_batch=64, seq_len=4096, micro_batch=1, virtual_stages=2)
    b = price_step(LLAMA8B, layout, t, Software(), cm.FITTED)
    m = layout.micro_batches
    assert m == 32
    stage_s = (b.compute_s + b.tp_exposed_s + b.cp_exposed_s + b.fsdp_exposed_s) / m
    assert b.pipeline_bubble_s == pytest.approx(7 / 2 * stage_s, rel=1e-12)
    assert b.pp_send_s > 0 and b.step_time_s == pytest.approx(sum(vars(b).values()))


def test_fsdp_communication_hides_behind_compute_until_the_network_is_too_slow():
    layout = Parallelism(dp=1, fsdp=8, tp=1, pp=1, cp=1, global_batch=16, seq_len=8192, micro_batch=2)
    one_node = price_step(LLAMA8B, layout, parse_topology("h100:1x8"), Software(), cm.FITTED)
    # The same 8 ranks one per node, on a network 1000x slower than InfiniBand: mostly exposed.
    slow = cm.Efficiency(**{**vars(cm.FITTED), "network": 0.001})
    spread = price_step(LLAMA8B, dataclasses.replace(layout, tp=8),
                        parse_topology("h100:8x8"), Software(), slow)
    assert one_node.fsdp_exposed_s < 0.01 * one_node.step_time_s
    assert spread.fsdp_exposed_s > 0.5 * spread.step_time_s
    assert not math.isclose(one_node.step_time_s, spread.step_time_s)



# --- FSDP and HSDP --------------------------------------------------------------------------------

def _fsdp_as_before(shape, layout, topology, software, eff):
    """fsdp_exposed_s and optimizer_s as priced before HSDP existed: the gathers and scatters over
    every data rank (with the context ranks), the optimizer sharded over them too."""
    layer = analytic._layer(shape, layout, topology, software, eff)
    span = cm.group_span(layout.data * layout.cp, layout.tp, topology.devices_per_node)
    layer_bytes = shape.layer_params / layout.tp
    ag = cm.collective_time_s("all-gather", layer_bytes * software.param_gather_bytes, span, topology, eff)
    rs = cm.collective_time_s("reduce-scatter", layer_bytes * software.grad_reduce_bytes, span, topology, eff)
    per_layer = cm.exposed_s(ag, layer.fwd_s) + cm.exposed_s(ag + rs, layer.bwd_s)
    fsdp_s = layout.micro_batches * (shape.layers / layout.pp * per_layer + ag)
    owned = (shape.layers * shape.layer_params + shape.embedding_params) / layout.tp / (layout.data * layout.cp)
    return fsdp_s, cm.memory_time_s(30 * owned, topology.device.hbm_bytes_per_s)


@pytest.mark.parametrize("topology, layout", [
    ("h100:16x8", Parallelism(dp=1, fsdp=128, tp=1, pp=1, cp=1, global_batch=128, seq_len=1024)),
    ("h100:4x8", Parallelism(dp=1, fsdp=8, tp=2, pp=1, cp=2, global_batch=32, seq_len=8192, micro_batch=2)),
])
def test_pure_fsdp_is_priced_as_before_hsdp(topology, layout):
    t = parse_topology(topology)
    software = Software(grad_reduce_bytes=4)
    b = price_step(LLAMA8B, layout, t, software, EFF)
    fsdp_s, optimizer_s = _fsdp_as_before(LLAMA8B, layout, t, software, EFF)
    assert b.fsdp_exposed_s > 0
    assert b.fsdp_exposed_s == pytest.approx(fsdp_s, rel=1e-12)
    assert b.optimizer_s == pytest.approx(optimizer_s, rel=1e-12)
    assert b.dp_exposed_s == 0.0  # one replica: nothing to all-reduce across


def test_hsdp_gathers_on_nvlink_and_all_reduces_only_the_shard_across_nodes():
    t = parse_topology("h100:16x8")
    fsdp = Parallelism(dp=1, fsdp=128, tp=1, pp=1, cp=1, global_batch=128, seq_len=512)
    hsdp = dataclasses.replace(fsdp, dp=16, fsdp=8)  # a shard group per node, 16 replicas
    software = Software()
    b_fsdp = price_step(LLAMA8B, fsdp, t, software, cm.FITTED)
    b_hsdp = price_step(LLAMA8B, hsdp, t, software, cm.FITTED)
    # The premise: FSDP over the network is communication bound at these short rows.
    assert b_fsdp.fsdp_exposed_s > 0.5 * b_fsdp.step_time_s
    assert b_hsdp.step_time_s < 0.8 * b_fsdp.step_time_s

    # HSDP's gathers are priced as an FSDP of 8 inside one node (NVLink only) ...
    one_node = dataclasses.replace(fsdp, fsdp=8, global_batch=8)  # same micro-batches per step
    assert cm.group_span(hsdp.shard_ranks, hsdp.tp, t.devices_per_node) == cm.GroupSpan(8, 1)
    fsdp_s, _ = _fsdp_as_before(LLAMA8B, one_node, parse_topology("h100:1x8"), software, cm.FITTED)
    assert b_hsdp.fsdp_exposed_s == pytest.approx(fsdp_s, rel=1e-12)
    # ... and the optimizer runs on 1/8 of the parameters (replicated over the 16 replicas).
    assert b_hsdp.optimizer_s == pytest.approx(16 * b_fsdp.optimizer_s, rel=1e-12)

    # Across nodes only the gradient shard is all-reduced, one GPU per node in the ring.
    shard_grad_bytes = LLAMA8B.params / 8 * software.grad_reduce_bytes
    all_reduce = cm.collective_time_s("all-reduce", shard_grad_bytes, cm.GroupSpan(1, 16), t, cm.FITTED)
    exposed = price_step(LLAMA8B, hsdp, t, dataclasses.replace(software, dp_overlap=False), cm.FITTED).dp_exposed_s
    assert exposed == pytest.approx(all_reduce, rel=1e-12)
    assert 0 < b_hsdp.dp_exposed_s < all_reduce  # overlapped with one micro-batch's backward


def test_hsdp_replicas_inside_a_node_reduce_on_nvlink():
    # 2 replicas of a 4-rank shard group on one 8-GPU node: nothing crosses the network, so a
    # network 1000x slower changes nothing.
    layout = Parallelism(dp=2, fsdp=4, tp=1, pp=1, cp=1, global_batch=16, seq_len=1024)
    t = parse_topology("h100:1x8")
    slow_network = cm.Efficiency(**{**vars(cm.FITTED), "network": 0.001})
    software = Software(dp_overlap=False)
    fast, slow = (price_step(LLAMA8B, layout, t, software, e) for e in (cm.FITTED, slow_network))
    assert fast.dp_exposed_s > 0 and fast == slow

"""XLA's own all-reduce kernels (one-shot to 256 KiB, two-shot to 2 MiB, one host's GPUs): the
strategies XLA annotates on the installed version, the option serving compiles with, and the
cost model pricing them only where they run (issue 30: a token step's tensor-parallel all-reduces)."""
import pytest

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.hlo_costs import CollectiveInfo
from xlaopt.analysis.schedule import build_schedule
from xlaopt.analysis.simulate import hlo_collective_time_s, simulate
from xlaopt.analysis.topology import cpu_simulation, parse_topology

NODE, TWO_NODES = parse_topology("h100:1x8"), parse_topology("h100:2x8")
KIB = 1024


def test_the_strategies_follow_xlas_limits():
    one_host = cm.GroupSpan(8, 1)
    assert cm.kernel_strategy(128 * KIB, one_host) == "one-shot"
    assert cm.kernel_strategy(256 * KIB, one_host) == "one-shot"
    assert cm.kernel_strategy(256 * KIB + 2, one_host) == "two-shot"
    assert cm.kernel_strategy(2048 * KIB, one_host) == "two-shot"
    assert cm.kernel_strategy(2048 * KIB + 2, one_host) is None
    assert cm.kernel_strategy(128 * KIB, cm.GroupSpan(8, 2)) is None  # XLA's kernels are one host's
    assert cm.kernel_strategy(128 * KIB, cm.GroupSpan(16, 1)) is None  # at most 8 ranks
    assert cm.kernel_strategy(128 * KIB, cm.GroupSpan(1, 1)) is None


def test_a_one_shot_kernel_is_two_barriers_and_every_peers_input_over_nvlink():
    level, eff = NODE.levels[0], cm.FITTED
    v = 128 * KIB
    t = cm.kernel_all_reduce_time_s("one-shot", v, 8, level, eff.nvlink, NODE.device.hbm_bytes_per_s)
    assert t == pytest.approx(2 * level.latency_s + 7 * v / (level.bytes_per_s * eff.nvlink)
                              + 2 * v / NODE.device.hbm_bytes_per_s)
    nccl = cm.collective_time_s("all-reduce", v, cm.GroupSpan(8, 1), NODE, eff)
    assert t < nccl / 1.5  # fewer latency steps than the double binary tree's 2 x log2(8)
    # Two-shot reads each peer's slice twice over; large enough, NCCL's ring is no slower.
    big = 2048 * KIB
    two = cm.kernel_all_reduce_time_s("two-shot", big, 8, level, eff.nvlink, NODE.device.hbm_bytes_per_s)
    assert two == pytest.approx(3 * level.latency_s + 2 * 7 / 8 * big / (level.bytes_per_s * eff.nvlink)
                                + 2 * big / NODE.device.hbm_bytes_per_s)
    with pytest.raises(ValueError, match="one-shot"):
        cm.kernel_all_reduce_time_s("three-shot", v, 8, level, eff.nvlink, 1.0)
    # Simulated CPU devices have no such kernel: NCCL's model there.
    cpu = cpu_simulation(8, host_flops=1e11)
    assert cm.serving_all_reduce_time_s(v, cm.GroupSpan(8, 1), cpu, eff) == cm.collective_time_s(
        "all-reduce", v, cm.GroupSpan(8, 1), cpu, eff)


HLO = """HloModule jit_step, is_scheduled=true

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (p: bf16[8,8192]) -> bf16[8,8192] {
  %p = bf16[8,8192]{1,0} parameter(0)
  %all-reduce-start = bf16[8,8192]{1,0} all-reduce-start(%p), channel_id=1, replica_groups={GROUPS}, use_global_device_ids=true, to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":true,"kernel_strategy":"KERNEL_STRATEGY_TRITON_ONE_SHOT"}}
  ROOT %all-reduce-done = bf16[8,8192]{1,0} all-reduce-done(%all-reduce-start)
}
"""


def test_the_simulator_prices_xlas_kernel_only_under_the_option_and_on_one_host():
    one_host = build_schedule(HLO.replace("GROUPS", "{0,1,2,3,4,5,6,7}"))
    (info,) = [op.collective for op in one_host.ops if op.collective is not None]
    assert info.kernel == "one-shot" and info.bytes == 128 * KIB
    kernel = cm.kernel_all_reduce_time_s("one-shot", 128 * KIB, 8, NODE.levels[0], cm.FITTED.nvlink,
                                         NODE.device.hbm_bytes_per_s)
    nccl = cm.collective_time_s("all-reduce", 128 * KIB, cm.GroupSpan(8, 1), NODE, cm.FITTED)
    assert simulate(one_host, NODE, kernels=True).step_time_s == pytest.approx(kernel)
    assert simulate(one_host, NODE).step_time_s == pytest.approx(nccl)
    # The same annotation over two hosts' GPUs: XLA falls back to NCCL at run time.
    across = CollectiveInfo("all-reduce", 128 * KIB, 128 * KIB, ((0, 8),), kernel="one-shot")
    assert hlo_collective_time_s(across, TWO_NODES, kernels=True) == hlo_collective_time_s(across, TWO_NODES)


def test_xla_annotates_its_kernels_where_the_cost_model_expects_them():
    """On the installed jax 0.10.2 plugin, deviceless for 8 H100: XLA's strategy annotation for
    all-reduces of 128 KiB, 1 MiB and 8 MiB equals `kernel_strategy`'s, and the HLO is the same with
    and without `ALL_REDUCE_KERNELS_OPTION` (it picks the thunk at run time, so one compile serves
    both prices in `analyze --serve`)."""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from xlaopt.analysis import gpu_aot

    mesh = gpu_aot.gpu_mesh(NODE, (8,), ("tensor",))
    seen = {}
    for rows in (8, 64, 512):  # bf16 [rows, 8192]: 128 KiB, 1 MiB, 8 MiB
        x = jax.ShapeDtypeStruct((rows, 8 * 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tensor")))
        w = jax.ShapeDtypeStruct((8 * 1024, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P("tensor", None)))
        lowered = jax.jit(jnp.dot, out_shardings=NamedSharding(mesh, P())).lower(x, w)
        texts = [lowered.compile(compiler_options=o).as_text() for o in ({cm.ALL_REDUCE_KERNELS_OPTION: True}, {})]
        assert texts[0] == texts[1]
        (start,) = [line for line in texts[0].splitlines() if "all-reduce-start(" in line]
        m = re.search(r'"kernel_strategy":"KERNEL_STRATEGY_([A-Z_]+)"', start)
        seen[rows] = m.group(1) if m else None
    expected = {rows: cm.kernel_strategy(rows * 8192 * 2, cm.GroupSpan(8, 1)) for rows in seen}
    assert expected == {8: "one-shot", 64: "two-shot", 512: None}
    assert seen == {8: "TRITON_ONE_SHOT", 64: "TRITON_TWO_SHOT", 512: "DEFAULT"}

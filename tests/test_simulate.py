"""The event simulation on hand-built schedules with hand-computed step times: a synchronous
collective adds to the step, an async one hides behind the compute between its start and done,
the rest is exposed and attributed to its mesh axis. And the Perfetto trace's structure."""
import dataclasses
import json

import pytest

from xlaopt.analysis import costmodel
from xlaopt.analysis.schedule import CollectiveInfo, Op, Schedule
from xlaopt.analysis.simulate import copy_time_s, hlo_collective_time_s, mfu, simulate, to_perfetto
from xlaopt.analysis.topology import Device, LinkLevel, Topology

# 1 TFLOP/s, 1 TB/s HBM, links of 100 GB/s with no latency, every efficiency 1: round numbers.
TOPO = Topology("toy:2x2", Device("toy", {"bfloat16": 1e12, "float32": 1e12}, 1e9, 1e12), nodes=2,
                devices_per_node=2, levels=(LinkLevel("fast", 100e9, 0.0), LinkLevel("slow", 10e9, 0.0)))
EFF = costmodel.Efficiency(matmul_max=1.0, matmul_max_ampere=1.0, matmul_half_flops=0.0, attention=1.0,
                           attention_flash2=1.0, nvlink=1.0, network=1.0)
MESH = {"data": 2, "fsdp": 2, "tensor": 1, "context": 1}  # data crosses nodes, fsdp stays inside


def compute(name, ms):
    flops = ms * 1e-3 * 1e12
    return Op(name, "fusion", "compute", "main", 0, flops=flops, bytes=0, matmuls=(flops,), dtype="bf16")


def gather(name, ms, kind="collective", group=(0, 1)):
    # ring all-gather over 2 devices in one node: 1/2 * V / 100 GB/s
    info = CollectiveInfo("all-gather", int(2 * ms * 1e-3 * 100e9), int(2 * ms * 1e-3 * 100e9), (group,))
    return Op(name, "all-gather-start" if kind == "collective-start" else "all-gather", kind, "main", 0,
              collective=info)


def done(name, start):
    return Op(name, "all-gather-done", "collective-done", "main", 0, operands=(start,))


def run(ops):
    return simulate(Schedule(ops, "main", [], {"main": ops}), TOPO, MESH, eff=EFF)


def test_sync_collective_adds_to_the_step():
    r = run([compute("a", 1), gather("g", 1), compute("b", 1)])
    assert r.step_time_s == pytest.approx(3e-3)
    assert r.exposed_comm_s == pytest.approx(1e-3)
    assert r.exposed_by_axis == {"fsdp": pytest.approx(1e-3)}
    assert r.compute_s == pytest.approx(2e-3)
    assert r.compute_idle_fraction == pytest.approx(1 / 3)


def test_async_collective_hides_behind_the_compute_between_start_and_done():
    r = run([gather("g", 1, "collective-start"), compute("a", 1), done("gd", "g"), compute("b", 1)])
    assert r.step_time_s == pytest.approx(2e-3)
    assert r.exposed_comm_s == pytest.approx(0.0)
    (c,) = r.collectives
    assert c["is_async"] and c["overlapped_compute_s"] == pytest.approx(1e-3)


def test_async_collective_longer_than_its_window_is_partly_exposed():
    r = run([gather("g", 2.5, "collective-start"), compute("a", 1), done("gd", "g"), compute("b", 1)])
    assert r.step_time_s == pytest.approx(3.5e-3)  # 2.5 ms gather, then b
    assert r.exposed_comm_s == pytest.approx(1.5e-3)
    assert r.collectives[0]["overlapped_compute_s"] == pytest.approx(1e-3)


def test_comm_stream_serialises_collectives():
    # two 1 ms gathers issued back to back overlap 1 ms of compute: the second ends at 2 ms
    ops = [gather("g1", 1, "collective-start"), gather("g2", 1, "collective-start"), compute("a", 1),
           done("d1", "g1"), done("d2", "g2"), compute("b", 1)]
    r = run(ops)
    assert r.step_time_s == pytest.approx(3e-3)
    assert r.exposed_comm_s == pytest.approx(1e-3)


def test_group_across_nodes_priced_hierarchically_on_its_axis():
    info = CollectiveInfo("all-reduce", 10**9, 10**9, ((0, 2),))  # devices 0 and 2: two nodes
    expected = costmodel.collective_time_s("all-reduce", 1e9, costmodel.GroupSpan(1, 2), TOPO, EFF)
    assert hlo_collective_time_s(info, TOPO, EFF) == pytest.approx(expected)
    assert expected == pytest.approx(min(2 * 0.5 * 1e9 / 10e9, 2 * 1e9 / 10e9))  # ring on the slow level
    r = run([Op("ar", "all-reduce", "collective", "main", 0, collective=info)])
    assert r.exposed_by_axis == {"data": pytest.approx(expected)}
    assert r.collectives[0]["link_level"] == "slow"


def test_cpu_fixups_price_narrow_bytes_and_sliced_all_reduce_as_reduce_scatter():
    info = CollectiveInfo("all-reduce", 4 * 10**8, 2 * 10**8, ((0, 1),), scattered_fraction=1.0)
    span = costmodel.GroupSpan(2, 1)
    assert hlo_collective_time_s(info, TOPO, EFF) == pytest.approx(
        costmodel.collective_time_s("all-reduce", 4e8, span, TOPO, EFF))
    assert hlo_collective_time_s(info, TOPO, EFF, cpu_fixups=True) == pytest.approx(
        costmodel.collective_time_s("reduce-scatter", 2e8, span, TOPO, EFF))


def p2p(name, kind, nbytes, pairs, opcode=None):
    """A collective-permute (sync or async), send or recv of `nbytes` over (source, target) pairs."""
    collective = "collective-permute" if kind.startswith("collective") else kind
    info = CollectiveInfo(collective, nbytes, nbytes, tuple(pairs))
    return Op(name, opcode or collective, kind, "main", 0, collective=info)


def test_collective_permute_is_priced_per_pair_over_the_link_between_its_devices():
    # 1e8 bytes: 1 ms over the fast link inside a node, 10 ms over the slow one between nodes
    inside = p2p("cp", "collective", 10**8, [(0, 1), (1, 0)])
    across = p2p("cp", "collective", 10**8, [(0, 2), (2, 0)])
    mixed = p2p("cp", "collective", 10**8, [(0, 1), (1, 2)])  # 1 -> 2 leaves node 0: the slowest pair
    assert hlo_collective_time_s(inside.collective, TOPO, EFF) == pytest.approx(1e-3)
    assert hlo_collective_time_s(across.collective, TOPO, EFF) == pytest.approx(10e-3)
    assert hlo_collective_time_s(mixed.collective, TOPO, EFF) == pytest.approx(10e-3)
    r = run([p2p("cps", "collective-start", 10**8, [(0, 1), (1, 0)], "collective-permute-start"),
             compute("a", 0.5), done("cpd", "cps"), compute("b", 1)])
    assert r.step_time_s == pytest.approx(2e-3)  # 1 ms permute behind 0.5 ms of compute, then b
    assert r.exposed_by_axis == {"fsdp": pytest.approx(0.5e-3)}


def test_all_to_all_sends_n_minus_1_over_n_of_each_buffer():
    # 4 devices on 2 nodes: (n-1)/n * V over the slow link; 2 inside a node: 1/2 * V over the fast one
    wide = CollectiveInfo("all-to-all", 4 * 10**7, 4 * 10**7, ((0, 1, 2, 3),))
    assert hlo_collective_time_s(wide, TOPO, EFF) == pytest.approx(3 / 4 * 4e7 / 10e9)  # 3 ms
    narrow = CollectiveInfo("all-to-all", 2 * 10**8, 2 * 10**8, ((0, 1),))
    assert hlo_collective_time_s(narrow, TOPO, EFF) == pytest.approx(1 / 2 * 2e8 / 100e9)  # 1 ms
    latency = Topology("toy", TOPO.device, 2, 2, (LinkLevel("fast", 100e9, 1e-6), LinkLevel("slow", 10e9, 5e-6)))
    assert hlo_collective_time_s(wide, latency, EFF) == pytest.approx(3 * 5e-6 + 3e-3)  # a latency per peer
    r = run([Op("a2a", "all-to-all", "collective", "main", 0, collective=wide), compute("a", 1)])
    assert r.step_time_s == pytest.approx(4e-3) and r.exposed_by_axis == {"data,fsdp": pytest.approx(3e-3)}


def test_send_and_recv_are_point_to_point_and_overlap_on_full_duplex_links():
    # 1e8 bytes to the neighbour inside the node: 1 ms each way
    send, recv = p2p("s", "send", 10**8, [(0, 1)]), p2p("r", "recv", 10**8, [(1, 0)])
    send_done = Op("sd", "send-done", "send-done", "main", 0, operands=("s",))
    recv_done = Op("rd", "recv-done", "recv-done", "main", 0, operands=("r",))
    assert hlo_collective_time_s(send.collective, TOPO, EFF) == pytest.approx(1e-3)
    # a send and a recv issued together use opposite directions: 1 ms, not 2
    r = run([recv, send, compute("a", 0.25), recv_done, send_done, compute("b", 1)])
    assert r.step_time_s == pytest.approx(2e-3)
    assert r.exposed_comm_s == pytest.approx(0.75e-3) and r.exposed_by_axis == {"fsdp": pytest.approx(0.75e-3)}
    assert {c["kind"]: c["time_s"] for c in r.collectives} == {"send": pytest.approx(1e-3),
                                                              "recv": pytest.approx(1e-3)}
    # two sends share the outgoing direction: one after the other
    r = run([send, dataclasses.replace(send, name="s2"), send_done,
             Op("sd2", "send-done", "send-done", "main", 0, operands=("s2",))])
    assert r.step_time_s == pytest.approx(2e-3)
    # across nodes: the slow link
    far = p2p("s", "send", 10**8, [(1, 2)])
    assert run([far, send_done]).step_time_s == pytest.approx(10e-3)


def test_copies_run_on_their_own_stream_at_hbm_bandwidth():
    # device-local: reads and writes its bytes, 2 x 5e8 / 1 TB/s = 1 ms; host <-> device: 1e9 / 1 TB/s = 1 ms
    local = Op("c", "copy-start", "copy-start", "main", 0, bytes=5 * 10**8)
    host = Op("h", "copy-start", "copy-start", "main", 0, bytes=10**9, host_transfer=True)
    assert copy_time_s(local, TOPO) == pytest.approx(1e-3) and copy_time_s(host, TOPO) == pytest.approx(1e-3)
    copy_done = Op("cd", "copy-done", "copy-done", "main", 0, operands=("c",))
    r = run([local, compute("a", 0.25), copy_done, compute("b", 1)])
    assert r.step_time_s == pytest.approx(2e-3)
    assert r.copy_s == pytest.approx(1e-3) and r.exposed_copy_s == pytest.approx(0.75e-3)
    assert r.comm_s == 0 and r.exposed_comm_s == 0  # a copy is not communication
    # the copy stream is separate from the collectives': a 1 ms gather and a 1 ms copy overlap
    r = run([gather("g", 1, "collective-start"), local, done("gd", "g"), copy_done])
    assert r.step_time_s == pytest.approx(1e-3)
    # copies share the copy stream: two 1 ms copies back to back
    r = run([local, host, copy_done, Op("hd", "copy-done", "copy-done", "main", 0, operands=("h",))])
    assert r.step_time_s == pytest.approx(2e-3) and r.exposed_copy_s == pytest.approx(2e-3)


def test_a_matmul_below_the_ridge_is_priced_by_its_bytes():
    """A decode step's gemm (few rows against a large weight) is bound by the weight's bytes: priced
    as memory-bound work, not by the fitted size curve and its fixed cost; a compute-bound matmul
    keeps the curve. The toy device's ridge: 1 FLOP a byte."""
    from xlaopt.analysis.simulate import compute_time_s

    eff = dataclasses.replace(EFF, matmul_half_flops=1e9)
    skinny = Op("gemv", "fusion", "compute", "main", 0, flops=1e8, bytes=int(1e9), matmuls=(1e8,), dtype="bf16")
    square = Op("gemm", "fusion", "compute", "main", 0, flops=1e10, bytes=int(1e9), matmuls=(1e10,), dtype="bf16")
    assert compute_time_s(skinny, TOPO, eff) == pytest.approx(1e-3)  # 1 GB at 1 TB/s
    assert compute_time_s(square, TOPO, eff) == pytest.approx(11e-3)  # (1e10 + 1e9) FLOPs at 1 TFLOP/s


def test_mfu():
    assert mfu(2e12, 1.0, TOPO, 4) == pytest.approx(0.5)


def test_perfetto_trace_structure():
    r = run([gather("g", 2.5, "collective-start"), compute("a", 1), done("gd", "g"), compute("b", 1)])
    trace = json.loads(json.dumps(to_perfetto(r)))
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} == {"g", "a", "b"}
    for e in complete:
        assert {"name", "ph", "pid", "tid", "ts", "dur"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    by = {(e["name"], e["tid"]): e for e in complete}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    compute_tid = next(t for t, n in threads.items() if n == "compute stream")
    comm_tid = next(t for t, n in threads.items() if n == "communication stream")
    assert by[("a", compute_tid)]["ts"] == 0 and by[("a", compute_tid)]["dur"] == pytest.approx(1000)  # us
    assert by[("b", compute_tid)]["ts"] == pytest.approx(2500)
    assert by[("g", comm_tid)]["dur"] == pytest.approx(2500)
    assert any(e["tid"] not in (compute_tid, comm_tid) and e["name"] == "g" for e in complete)  # the wait

"""The event simulation on hand-built schedules with hand-computed step times: a synchronous
collective adds to the step, an async one hides behind the compute between its start and done,
the rest is exposed and attributed to its mesh axis. And the Perfetto trace's structure."""
import json

import pytest

from xlaopt.analysis import costmodel
from xlaopt.analysis.schedule import CollectiveInfo, Op, Schedule
from xlaopt.analysis.simulate import collective_time_s, mfu, simulate, to_perfetto
from xlaopt.analysis.topology import Device, LinkLevel, Topology

# 1 TFLOP/s, 1 TB/s HBM, links of 100 GB/s with no latency, every efficiency 1: round numbers.
TOPO = Topology("toy:2x2", Device("toy", {"bfloat16": 1e12, "float32": 1e12}, 1e9, 1e12), nodes=2,
                devices_per_node=2, levels=(LinkLevel("fast", 100e9, 0.0), LinkLevel("slow", 10e9, 0.0)))
EFF = costmodel.Efficiency(matmul_max=1.0, matmul_max_ampere=1.0, matmul_half_flops=0.0, attention=1.0,
                           nvlink=1.0, network=1.0)
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
    assert collective_time_s(info, TOPO, EFF) == pytest.approx(expected)
    assert expected == pytest.approx(min(2 * 0.5 * 1e9 / 10e9, 2 * 1e9 / 10e9))  # ring on the slow level
    r = run([Op("ar", "all-reduce", "collective", "main", 0, collective=info)])
    assert r.exposed_by_axis == {"data": pytest.approx(expected)}
    assert r.collectives[0]["link_level"] == "slow"


def test_cpu_fixups_price_narrow_bytes_and_sliced_all_reduce_as_reduce_scatter():
    info = CollectiveInfo("all-reduce", 4 * 10**8, 2 * 10**8, ((0, 1),), scattered_fraction=1.0)
    span = costmodel.GroupSpan(2, 1)
    assert collective_time_s(info, TOPO, EFF) == pytest.approx(
        costmodel.collective_time_s("all-reduce", 4e8, span, TOPO, EFF))
    assert collective_time_s(info, TOPO, EFF, cpu_fixups=True) == pytest.approx(
        costmodel.collective_time_s("reduce-scatter", 2e8, span, TOPO, EFF))


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

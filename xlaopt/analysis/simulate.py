"""An event simulation of a compiled step's schedule on a cluster topology.

Two streams per device, as on a GPU: compute (kernels, in schedule order) and communication
(collectives, one at a time, in the order they are issued). Every device runs the same SPMD
program, so one device is simulated.

- A compute op takes its roofline time (`xlaopt.analysis.costmodel`, `FITTED` efficiencies): the larger
  of its matmuls at the dtype's peak times the size-dependent matmul efficiency, and its bytes at
  the HBM bandwidth. Elementwise work is priced by bytes only; kernel launch overheads are not
  modelled.
- A collective is priced by `costmodel.collective_time_s` over the link levels its replica group
  spans (a ring inside a node, hierarchical across nodes; all-reduce takes the faster of ring and
  tree); all-to-all as direct sends, (n-1) latencies + (n-1)/n * V / W; collective-permute as one
  send over the outermost level any of its pairs crosses.
- A synchronous collective blocks the compute stream until it ends (and waits for the comm stream
  to be free). An async start issues the collective on the comm stream and compute goes on; its
  done blocks compute until the collective has ended. Compute blocked on communication is the
  exposed communication, attributed to the collective waited on and its mesh axes.

Options for schedules compiled on CPU (`cpu_fixups=True`): XLA's CPU pipeline runs bf16 matmuls in
f32, widens bf16 collectives to f32 and leaves FSDP gradient reductions as all-reduce + slice. With
the fix-ups, matmuls are priced at `matmul_dtype`'s peak, collectives at their narrow (pre-widening)
bytes, all-reduces whose results are only sliced as reduce-scatters, and f32 -> bf16 -> f32
round-trip fusions as free. The CPU schedule is still sequential: nothing overlaps.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses

from xlaopt.analysis import costmodel
from xlaopt.analysis.hlo import group_axes
from xlaopt.analysis.schedule import CollectiveInfo, Op, Schedule
from xlaopt.analysis.topology import Topology

HLO_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float32", "f8e4m3fn": "float8",
              "f8e5m2": "float8", "s8": "float8", "u8": "float8"}


@dataclasses.dataclass(frozen=True)
class Event:
    stream: str  # "compute" | "comm" | "wait"
    name: str
    kind: str
    start_s: float
    dur_s: float
    axes: str = ""
    bytes: int = 0
    flops: float = 0.0


@dataclasses.dataclass
class SimResult:
    step_time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    exposed_by_axis: dict
    comm_by_axis: dict  # axes -> {"bytes": per step, "time_s": per step, "exposed_s": ...}
    compute_idle_fraction: float
    comm_idle_fraction: float
    flops_per_device: float
    collectives: list  # one dict per collective instruction, aggregated over its executions
    timeline: list  # Events

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("timeline")
        return d


def _peak(topology: Topology, dtype_name: str) -> float:
    peaks = topology.device.peak_flops
    return peaks.get(dtype_name) or peaks.get("bfloat16") or max(peaks.values())


def compute_time_s(op: Op, topology: Topology, eff: costmodel.Efficiency = costmodel.FITTED,
                   matmul_dtype: str | None = None, cpu_fixups: bool = False) -> float:
    """Roofline time of one compute op on one device of `topology`."""
    if cpu_fixups and op.widening_roundtrip:
        return 0.0
    hbm = topology.device.hbm_bytes_per_s
    memory = op.bytes / hbm if hbm > 0 else 0.0
    if not op.matmuls:
        return memory
    peak = _peak(topology, matmul_dtype or HLO_DTYPES.get(op.dtype or "", "bfloat16"))
    mmax = eff.matmul_max_for(topology.device.name)
    matmul = sum(costmodel.matmul_time_s(f, peak, f, mmax, eff.matmul_half_flops) for f in op.matmuls)
    return max(matmul, memory)


def _span(group, topology: Topology) -> costmodel.GroupSpan:
    per_node = collections.Counter(d // topology.devices_per_node for d in group)
    return costmodel.GroupSpan(max(per_node.values()), len(per_node))


def _link_eff(level, topology: Topology, eff: costmodel.Efficiency) -> float:
    return eff.nvlink if level is topology.levels[0] else eff.network


def collective_time_s(info: CollectiveInfo, topology: Topology, eff: costmodel.Efficiency = costmodel.FITTED,
                      cpu_fixups: bool = False) -> float:
    """Time of one execution of a collective on `topology` (devices numbered node-major)."""
    volume = info.narrow_bytes if cpu_fixups else info.bytes
    if not info.replica_groups or volume <= 0:
        return 0.0
    group = info.replica_groups[0]
    n = len(group)
    if info.kind == "collective-permute":
        pairs = info.replica_groups
        level = max((topology.level_of(p) for p in pairs), key=lambda l: topology.levels.index(l))
        return costmodel.send_time_s(volume, level, _link_eff(level, topology, eff))
    if n <= 1:
        return 0.0
    span = _span(group, topology)
    if info.kind in costmodel.COLLECTIVE_KINDS:
        if info.kind == "all-reduce" and cpu_fixups and info.scattered_fraction > 0:
            f = info.scattered_fraction
            return (costmodel.collective_time_s("reduce-scatter", volume * f, span, topology, eff)
                    + costmodel.collective_time_s("all-reduce", volume * (1 - f), span, topology, eff))
        return costmodel.collective_time_s(info.kind, volume, span, topology, eff)
    level = topology.level_of(group)
    bandwidth = level.bytes_per_s * _link_eff(level, topology, eff)
    if info.kind in ("all-to-all", "ragged-all-to-all"):
        return (n - 1) * level.latency_s + (n - 1) / n * volume / bandwidth
    # collective-broadcast: a ring all-gather's cost
    return costmodel.collective_time_s("all-gather", volume, span, topology, eff)


def simulate(schedule: Schedule, topology: Topology, mesh_shape: dict[str, int] | None = None,
             eff: costmodel.Efficiency = costmodel.FITTED, matmul_dtype: str | None = None,
             cpu_fixups: bool = False, keep_timeline: bool = True) -> SimResult:
    """Run the schedule's ops through the compute and communication streams."""
    tc = tn = 0.0  # when the compute / comm stream is next free
    compute_busy = comm_busy = 0.0
    exposed_by_axis: dict[str, float] = collections.defaultdict(float)
    comm_by_axis: dict[str, dict] = {}
    pending: dict[str, tuple] = {}  # start name -> (op, begin, end)
    fifo: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    per_instr: dict[tuple, dict] = {}
    windows: list[tuple] = []  # (key, begin, end) of every async collective execution
    timeline: list[Event] = []
    compute_starts: list[float] = []
    compute_cum: list[float] = [0.0]  # compute busy time before each compute event
    compute_durs: list[float] = []
    axes_cache: dict[int, str] = {}
    level_cache: dict[int, str] = {}

    def axes_of(info: CollectiveInfo) -> str:
        key = id(info)
        if key not in axes_cache:
            axes = group_axes(info.replica_groups, mesh_shape) if mesh_shape and info.replica_groups else ()
            axes_cache[key] = ",".join(axes) or "-"
            level_cache[key] = topology.level_of(info.replica_groups[0]).name if info.replica_groups else "-"
        return axes_cache[key]

    def record(op: Op, begin: float, dur: float, exposed: float, is_async: bool) -> dict:
        info = op.collective
        axes = axes_of(info)
        entry = per_instr.setdefault((op.computation, op.name), {
            "name": op.name, "kind": info.kind, "computation": op.computation, "position": op.position,
            "is_async": is_async, "mesh_axes": axes, "link_level": level_cache[id(info)],
            "group_size": info.group_size, "bytes": info.bytes,
            "priced_bytes": info.narrow_bytes if cpu_fixups else info.bytes,
            "executions": 0, "time_s": 0.0, "exposed_s": 0.0, "overlapped_compute_s": 0.0})
        entry["executions"] += 1
        entry["time_s"] += dur
        entry["exposed_s"] += exposed
        by = comm_by_axis.setdefault(axes, {"bytes": 0, "time_s": 0.0, "exposed_s": 0.0})
        by["bytes"] += entry["priced_bytes"]
        by["time_s"] += dur
        by["exposed_s"] += exposed
        if keep_timeline:
            timeline.append(Event("comm", op.name, info.kind, begin, dur, axes, entry["priced_bytes"]))
        return entry

    for op in schedule.ops:
        if op.kind == "compute":
            d = compute_time_s(op, topology, eff, matmul_dtype, cpu_fixups)
            if d <= 0:
                continue
            compute_starts.append(tc)
            compute_durs.append(d)
            compute_cum.append(compute_cum[-1] + d)
            if keep_timeline:
                timeline.append(Event("compute", op.name, op.opcode, tc, d, flops=op.flops, bytes=op.bytes))
            tc += d
            compute_busy += d
        elif op.kind == "collective":
            d = collective_time_s(op.collective, topology, eff, cpu_fixups)
            begin = max(tc, tn)
            end = begin + d
            exposed = end - tc
            record(op, begin, d, exposed, False)
            exposed_by_axis[axes_of(op.collective)] += exposed
            if keep_timeline and exposed > 0:
                timeline.append(Event("wait", op.name, "blocked", tc, exposed, axes_of(op.collective)))
            comm_busy += d
            tc = tn = end
        elif op.kind == "collective-start":
            d = collective_time_s(op.collective, topology, eff, cpu_fixups)
            begin = max(tc, tn)
            end = begin + d
            tn = end
            comm_busy += d
            pending[op.name] = (op, begin, end)
            fifo[op.collective.kind].append(op.name)
        elif op.kind == "collective-done":
            start = next((o for o in op.operands if o in pending), None)
            if start is None:  # pipelined across iterations: the oldest outstanding start
                for kind in (k for k in fifo if fifo[k]):
                    start = fifo[kind][0]
                    break
            if start is None:
                continue
            sop, begin, end = pending.pop(start)
            fifo[sop.collective.kind].remove(start)
            exposed = max(0.0, end - tc)
            entry = record(sop, begin, end - begin, exposed, True)
            exposed_by_axis[entry["mesh_axes"]] += exposed
            windows.append(((sop.computation, sop.name), begin, end))
            if keep_timeline and exposed > 0:
                timeline.append(Event("wait", sop.name, "blocked", tc, exposed, entry["mesh_axes"]))
            tc = max(tc, end)
    for start, (sop, begin, end) in list(pending.items()):  # never waited on: runs to the end
        entry = record(sop, begin, end - begin, 0.0, True)
        windows.append(((sop.computation, sop.name), begin, end))

    def busy_until(t: float) -> float:
        i = bisect.bisect_right(compute_starts, t) - 1
        if i < 0:
            return 0.0
        return compute_cum[i] + min(t - compute_starts[i], compute_durs[i])

    for key, begin, end in windows:
        per_instr[key]["overlapped_compute_s"] += busy_until(end) - busy_until(begin)

    step = max(tc, tn)
    exposed_total = sum(exposed_by_axis.values())
    return SimResult(
        step_time_s=step, compute_s=compute_busy, comm_s=comm_busy, exposed_comm_s=exposed_total,
        exposed_by_axis=dict(exposed_by_axis), comm_by_axis=comm_by_axis,
        compute_idle_fraction=1 - compute_busy / step if step > 0 else 0.0,
        comm_idle_fraction=1 - comm_busy / step if step > 0 else 0.0,
        flops_per_device=schedule.flops,
        collectives=sorted(per_instr.values(), key=lambda c: -c["time_s"]),
        timeline=timeline)


def mfu(model_flops_per_step: float, step_time_s: float, topology: Topology, num_devices: int,
        dtype: str = "bfloat16") -> float:
    """Model FLOPs / (step time x datasheet peak x devices)."""
    if step_time_s <= 0:
        return 0.0
    return model_flops_per_step / (step_time_s * _peak(topology, dtype) * num_devices)


def to_perfetto(timeline, name: str = "xlaopt simulated step") -> dict:
    """Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): one process, a thread per
    stream, complete ("X") events with microsecond timestamps."""
    events = timeline.timeline if isinstance(timeline, SimResult) else timeline
    tids = {"compute": 1, "wait": 2, "comm": 3}
    labels = {"compute": "compute stream", "wait": "compute blocked on communication", "comm": "communication stream"}
    trace = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": name}}]
    trace += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": labels[s]}}
              for s, tid in tids.items()]
    trace += [{"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}}
              for tid in tids.values()]
    for e in events:
        args = {k: v for k, v in (("axes", e.axes), ("bytes", e.bytes), ("flops", e.flops)) if v}
        trace.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": 1, "tid": tids[e.stream],
                      "ts": round(e.start_s * 1e6, 3), "dur": round(max(e.dur_s, 0.0) * 1e6, 3), "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def bounds(result: SimResult) -> dict:
    """The schedule-free limits: everything serial vs communication perfectly hidden."""
    return {"serial_s": result.compute_s + result.comm_s, "perfect_overlap_s": max(result.compute_s, result.comm_s)}


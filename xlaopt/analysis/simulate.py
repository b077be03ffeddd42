"""An event simulation of a compiled step's schedule on a cluster topology.

Two streams per device, as on a GPU: compute (kernels, in schedule order) and communication
(collectives, one at a time, in the order they are issued). Every device runs the same SPMD
program, so one device is simulated.

- A compute op takes its roofline time (`xlaopt.analysis.costmodel`, `FITTED` efficiencies): the larger
  of its matmuls at the dtype's peak times the size-dependent matmul efficiency, and its bytes at
  the HBM bandwidth. Elementwise work is priced by bytes only; kernel launch overheads are not
  modelled.
- A collective is priced by its kind (`_PRICES`): all-gather, reduce-scatter and all-reduce by
  `costmodel.collective_time_s` over the link levels the replica group spans (a ring inside a
  node, hierarchical across nodes; all-reduce takes the faster of ring and tree); all-to-all as
  direct sends, each device sending (n-1)/n of its buffer: (n-1) latencies + (n-1)/n * V / W;
  collective-permute, send and recv as point-to-point transfers, every (source, target) pair at
  once, each over the link level between its two devices: latency + V / W, the slowest pair's.
- Each op kind of the schedule has its handler (`_HANDLERS`). A synchronous collective blocks the
  compute stream until it ends (and waits for the comm stream to be free). An async start issues
  the collective on the comm stream and compute goes on; its done blocks compute until the
  collective has ended. Links are full duplex (bandwidths are per direction): a collective uses
  both directions, a send only the outgoing and a recv only the incoming one, so a send and a
  recv issued together overlap; send-done / recv-done block compute until their transfer ends.
  Compute blocked on communication is the exposed communication, attributed to the collective
  waited on and its mesh axes.
- An async copy (copy-start / copy-done) runs on a third stream, the copy engines, priced at the
  HBM bandwidth (`copy_time_s`); copy-done blocks compute until it ends.

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

HLO_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "tf32": "tfloat32", "f64": "float32",
              "f8e4m3fn": "float8",
              "f8e5m2": "float8", "s8": "float8", "u8": "float8"}


@dataclasses.dataclass(frozen=True)
class Event:
    stream: str  # "compute" | "comm" | "wait" | "copy"
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
    copy_s: float = 0.0  # async copies (copy-start / copy-done) on the copy stream
    exposed_copy_s: float = 0.0  # compute blocked on a copy-done
    # Each entry-level loop's time on the compute stream (its first op's start to its last op's
    # end, every wait inside counted), by loop name.
    loop_time_s: dict = dataclasses.field(default_factory=dict)
    # The same for the ops each branch rule chose (`Schedule.branch_spans`), summed by name scope.
    branch_time_s: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("timeline")
        return d


def _peak(topology: Topology, dtype_name: str) -> float:
    peaks = topology.device.peak_flops
    if dtype_name == "tfloat32" and dtype_name not in peaks:  # a device without TF32 runs f32
        dtype_name = "float32"
    return peaks.get(dtype_name) or peaks.get("bfloat16") or max(peaks.values())


def compute_time_s(op: Op, topology: Topology, eff: costmodel.Efficiency = costmodel.FITTED,
                   matmul_dtype: str | None = None, cpu_fixups: bool = False) -> float:
    """Roofline time of one compute op on one device of `topology`."""
    if cpu_fixups and op.widening_roundtrip:
        return 0.0
    hbm = topology.device.hbm_bytes_per_s
    memory = op.bytes / hbm if hbm > 0 else 0.0
    if op.fused_attention:  # a fused kernel: its own efficiency, not the matmul size curve
        return max(costmodel.attention_time_s(op.flops, _peak(topology, "bfloat16"), eff), memory)
    if not op.matmuls:
        return memory
    peak = _peak(topology, matmul_dtype or HLO_DTYPES.get(op.dtype or "", "bfloat16"))
    mmax = eff.matmul_max_for(topology.device.name)
    if hbm > 0 and op.repeat * sum(op.matmuls) < op.bytes * peak * mmax / hbm:
        # Below the ridge point a matmul is bound by its bytes (a decode step's few rows against
        # every weight): priced as memory-bound work is. The size curve was fitted on training
        # steps, whose matmuls are compute-bound, and its fixed cost a matmul (some 56 us on an
        # H100) would price a decode step's 481 skinny gemms at 27 ms against 6 ms of their bytes.
        return memory
    matmul = op.repeat * sum(costmodel.matmul_time_s(f, peak, f, mmax, eff.matmul_half_flops) for f in op.matmuls)
    return max(matmul, memory)


def _span(group, topology: Topology) -> costmodel.GroupSpan:
    per_node = collections.Counter(topology.node_of(d) for d in group)
    return costmodel.GroupSpan(max(per_node.values()), len(per_node))


def _link_eff(level, topology: Topology, eff: costmodel.Efficiency) -> float:
    return eff.nvlink if level is topology.levels[0] else eff.network


def _ring_or_tree(info: CollectiveInfo, volume: float, topology: Topology, eff: costmodel.Efficiency,
                  cpu_fixups: bool) -> float:
    """all-gather, reduce-scatter, all-reduce: the cost model's algorithms over the group's span."""
    span = _span(info.replica_groups[0], topology)
    if info.kind == "all-reduce" and cpu_fixups and info.scattered_fraction > 0:
        f = info.scattered_fraction
        return (costmodel.collective_time_s("reduce-scatter", volume * f, span, topology, eff)
                + costmodel.collective_time_s("all-reduce", volume * (1 - f), span, topology, eff))
    return costmodel.collective_time_s(info.kind, volume, span, topology, eff)


def _all_to_all(info: CollectiveInfo, volume: float, topology: Topology, eff: costmodel.Efficiency,
                cpu_fixups: bool) -> float:
    """Direct sends: each device sends (n-1)/n of its buffer (V), one latency per peer, over the
    outermost level the group spans."""
    group = info.replica_groups[0]
    n = len(group)
    level = topology.level_of(group)
    bandwidth = level.bytes_per_s * _link_eff(level, topology, eff)
    return (n - 1) * level.latency_s + (n - 1) / n * volume / bandwidth


def _point_to_point(info: CollectiveInfo, volume: float, topology: Topology, eff: costmodel.Efficiency,
                    cpu_fixups: bool) -> float:
    """collective-permute, send, recv: every (source, target) pair sends the whole buffer at once,
    over the link level between its two devices; the slowest pair sets the time."""
    return max(costmodel.send_time_s(volume, level, _link_eff(level, topology, eff))
               for level in (topology.level_of(pair) for pair in info.replica_groups))


def _broadcast(info: CollectiveInfo, volume: float, topology: Topology, eff: costmodel.Efficiency,
               cpu_fixups: bool) -> float:
    """collective-broadcast: a ring all-gather's cost."""
    return costmodel.collective_time_s("all-gather", volume, _span(info.replica_groups[0], topology), topology, eff)


# Collective kind -> its price; each gets (info, volume, topology, efficiencies, cpu_fixups).
_PRICES = {"all-gather": _ring_or_tree, "reduce-scatter": _ring_or_tree, "all-reduce": _ring_or_tree,
           "all-to-all": _all_to_all, "ragged-all-to-all": _all_to_all, "collective-permute": _point_to_point,
           "send": _point_to_point, "recv": _point_to_point, "collective-broadcast": _broadcast}
_POINT_TO_POINT = ("collective-permute", "send", "recv")


def hlo_collective_time_s(info: CollectiveInfo, topology: Topology, eff: costmodel.Efficiency = costmodel.FITTED,
                          cpu_fixups: bool = False, kernels: bool = False) -> float:
    """Time of one execution of a collective on `topology` (logical devices placed by its `placement`);
    `kernels`: compiled with `costmodel.ALL_REDUCE_KERNELS_OPTION`, so an all-reduce XLA annotated
    for its own kernel runs it, where the group is one host's (XLA checks that at run time)."""
    volume = info.narrow_bytes if cpu_fixups else info.bytes
    if not info.replica_groups or volume <= 0:
        return 0.0
    if info.kind not in _POINT_TO_POINT and len(info.replica_groups[0]) <= 1:
        return 0.0
    if kernels and info.kernel:
        span = _span(info.replica_groups[0], topology)
        if costmodel.kernel_strategy(volume, span) is not None:
            return costmodel.kernel_time_on(info.kernel, volume, span, topology, eff)
    return _PRICES[info.kind](info, volume, topology, eff, cpu_fixups)


def copy_time_s(op: Op, topology: Topology) -> float:
    """An async copy of `op.bytes` bytes (copy-start / copy-done), on the device's copy engines.

    Of the topology's bandwidths (per-device HBM, and the link levels between devices) HBM is the
    honest one: a copy crosses no link between devices. A copy inside device memory reads and
    writes its bytes, 2 V / HBM, as a compute op's memory time counts operand plus result. A copy
    between host and device memory (`op.host_transfer`) reads or writes device memory once, V /
    HBM; the host link (PCIe, NVLink-C2C) is not in the topology, so for those this is a lower
    bound (a PCIe host link is far slower than HBM)."""
    hbm = topology.device.hbm_bytes_per_s
    if hbm <= 0 or op.bytes <= 0:
        return 0.0
    return (1 if op.host_transfer else 2) * op.bytes / hbm


def _instruction(op: Op) -> tuple:
    """What an op's time depends on: its instruction, and the runs a once-priced loop op stands for."""
    return op.computation, op.name, op.repeat


class _Run:
    """The simulation's state: when each stream is next free, the async operations in flight,
    and what has been accounted; one method per op kind (see `_HANDLERS`)."""

    def __init__(self, topology: Topology, mesh_shape: dict[str, int] | None, eff: costmodel.Efficiency,
                 matmul_dtype: str | None, cpu_fixups: bool, keep_timeline: bool, kernels: bool = False):
        self.topology, self.mesh_shape, self.eff = topology, mesh_shape, eff
        self.matmul_dtype, self.cpu_fixups, self.keep_timeline = matmul_dtype, cpu_fixups, keep_timeline
        self.kernels = kernels
        self.tc = 0.0  # when the compute stream is next free
        self.t_out = self.t_in = 0.0  # when the links' outgoing / incoming directions are next free
        self.t_copy = 0.0  # when the copy stream is next free
        self.compute_busy = self.comm_busy = self.copy_busy = self.exposed_copy = 0.0
        self.exposed_by_axis: dict[str, float] = collections.defaultdict(float)
        self.comm_by_axis: dict[str, dict] = {}
        self.pending: dict[str, tuple] = {}  # start name -> (op, begin, end)
        self.fifo: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.copies: dict[str, tuple[float, float]] = {}  # copy-start name -> (begin, end)
        self.per_instr: dict[tuple, dict] = {}
        self.windows: list[tuple] = []  # (key, begin, end) of every async collective execution
        self.timeline: list[Event] = []
        self.compute_starts: list[float] = []
        self.compute_cum: list[float] = [0.0]  # compute busy time before each compute event
        self.compute_durs: list[float] = []
        self._axes: dict[int, str] = {}
        self._level: dict[int, str] = {}
        # An op's time depends on the instruction alone (and, for a loop priced once per op, its
        # runs), not on which expansion of a loop or branch it is: priced once each (a pipeline's
        # schedule runs some 350,000 ops expanded from a few thousand instructions).
        self._compute_s: dict[tuple, float] = {}
        self._collective_s: dict[tuple, float] = {}

    # --- accounting ------------------------------------------------------------------------
    def axes_of(self, info: CollectiveInfo) -> str:
        key = id(info)
        if key not in self._axes:
            groups = info.replica_groups
            axes = group_axes(groups, self.mesh_shape) if self.mesh_shape and groups else ()
            self._axes[key] = ",".join(axes) or "-"
            self._level[key] = self.topology.level_of(groups[0]).name if groups else "-"
        return self._axes[key]

    def record(self, op: Op, begin: float, dur: float, exposed: float, is_async: bool) -> dict:
        info = op.collective
        axes = self.axes_of(info)
        entry = self.per_instr.setdefault((op.computation, op.name), {
            "name": op.name, "kind": info.kind, "computation": op.computation, "position": op.position,
            "is_async": is_async, "mesh_axes": axes, "link_level": self._level[id(info)],
            "group_size": info.group_size, "bytes": info.bytes,
            "priced_bytes": info.narrow_bytes if self.cpu_fixups else info.bytes,
            "executions": 0, "time_s": 0.0, "exposed_s": 0.0, "overlapped_compute_s": 0.0})
        entry["executions"] += 1
        entry["time_s"] += dur
        entry["exposed_s"] += exposed
        by = self.comm_by_axis.setdefault(axes, {"bytes": 0, "time_s": 0.0, "exposed_s": 0.0})
        by["bytes"] += entry["priced_bytes"]
        by["time_s"] += dur
        by["exposed_s"] += exposed
        if self.keep_timeline:
            self.timeline.append(Event("comm", op.name, info.kind, begin, dur, axes, entry["priced_bytes"]))
        return entry

    def _collective_time(self, op: Op) -> float:
        key = _instruction(op)
        d = self._collective_s.get(key)
        if d is None:
            d = self._collective_s[key] = self._price_collective(op)
        return d

    def _price_collective(self, op: Op) -> float:
        if op.host_transfer:  # a send / recv between host and device: priced as a host copy
            return copy_time_s(dataclasses.replace(op, bytes=op.collective.bytes), self.topology)
        return hlo_collective_time_s(op.collective, self.topology, self.eff, self.cpu_fixups, self.kernels)

    def _wait(self, name: str, end: float, axes: str) -> float:
        """Compute waits for something ending at `end`: the exposed time."""
        exposed = max(0.0, end - self.tc)
        if self.keep_timeline and exposed > 0:
            self.timeline.append(Event("wait", name, "blocked", self.tc, exposed, axes))
        self.tc = max(self.tc, end)
        return exposed

    def _finish(self, sop: Op, begin: float, end: float) -> None:
        """An async collective or transfer waited on: its time, the compute blocked on it."""
        exposed = max(0.0, end - self.tc)
        entry = self.record(sop, begin, end - begin, exposed, True)
        self.exposed_by_axis[entry["mesh_axes"]] += exposed
        self.windows.append(((sop.computation, sop.name), begin, end))
        self._wait(sop.name, end, entry["mesh_axes"])

    # --- one handler per op kind -------------------------------------------------------------
    def compute(self, op: Op) -> None:
        key = _instruction(op)
        d = self._compute_s.get(key)
        if d is None:
            d = self._compute_s[key] = compute_time_s(op, self.topology, self.eff, self.matmul_dtype,
                                                         self.cpu_fixups)
        if d <= 0:
            return
        self.compute_starts.append(self.tc)
        self.compute_durs.append(d)
        self.compute_cum.append(self.compute_cum[-1] + d)
        if self.keep_timeline:
            self.timeline.append(Event("compute", op.name, op.opcode, self.tc, d, flops=op.flops, bytes=op.bytes))
        self.tc += d
        self.compute_busy += d

    def collective(self, op: Op) -> None:
        """Synchronous: waits for the links (both directions), blocks compute until it ends."""
        d = self._collective_time(op)
        begin = max(self.tc, self.t_out, self.t_in)
        end = begin + d
        exposed = end - self.tc
        self.record(op, begin, d, exposed, False)
        self.exposed_by_axis[self.axes_of(op.collective)] += exposed
        if self.keep_timeline and exposed > 0:
            self.timeline.append(Event("wait", op.name, "blocked", self.tc, exposed, self.axes_of(op.collective)))
        self.comm_busy += d
        self.tc = self.t_out = self.t_in = end

    def collective_start(self, op: Op) -> None:
        d = self._collective_time(op)
        begin = max(self.tc, self.t_out, self.t_in)
        self.t_out = self.t_in = begin + d
        self.comm_busy += d
        self.pending[op.name] = (op, begin, begin + d)
        self.fifo[op.collective.kind].append(op.name)

    def collective_done(self, op: Op) -> None:
        start = next((o for o in op.operands if o in self.pending), None)
        if start is None:  # pipelined across iterations: the oldest outstanding start
            for kind in (k for k in self.fifo if self.fifo[k]):
                start = self.fifo[kind][0]
                break
        if start is None:
            return
        sop, begin, end = self.pending.pop(start)
        self.fifo[sop.collective.kind].remove(start)
        self._finish(sop, begin, end)

    def send(self, op: Op) -> None:
        """A point-to-point send: the links' outgoing direction only."""
        self.t_out = self._one_way(op, self.t_out)

    def recv(self, op: Op) -> None:
        """A point-to-point receive: the links' incoming direction only."""
        self.t_in = self._one_way(op, self.t_in)

    def _one_way(self, op: Op, lane_free_at: float) -> float:
        """Start `op` when compute has issued it and its link direction is free (links are full
        duplex: a send and a receive overlap); returns when that direction is free again."""
        d = self._collective_time(op)
        begin = max(self.tc, lane_free_at)
        self.comm_busy += d
        self.pending[op.name] = (op, begin, begin + d)
        return begin + d

    def transfer_done(self, op: Op) -> None:
        """send-done / recv-done: compute waits for its own send or recv."""
        start = next((o for o in op.operands if o in self.pending), None)
        if start is not None:
            self._finish(*self.pending.pop(start))

    def copy_start(self, op: Op) -> None:
        d = copy_time_s(op, self.topology)
        begin = max(self.tc, self.t_copy)
        self.t_copy = begin + d
        self.copy_busy += d
        self.copies[op.name] = (begin, begin + d)
        if self.keep_timeline and d > 0:
            self.timeline.append(Event("copy", op.name, "host-copy" if op.host_transfer else "copy", begin, d,
                                       bytes=op.bytes))

    def copy_done(self, op: Op) -> None:
        start = next((o for o in op.operands if o in self.copies), None)
        if start is not None:
            _, end = self.copies.pop(start)
            self.exposed_copy += self._wait(start, end, "copy")

    # --- the result ------------------------------------------------------------------------
    def result(self, schedule: Schedule) -> SimResult:
        for sop, begin, end in list(self.pending.values()):  # never waited on: runs to the end
            self.record(sop, begin, end - begin, 0.0, True)
            self.windows.append(((sop.computation, sop.name), begin, end))

        def busy_until(t: float) -> float:
            i = bisect.bisect_right(self.compute_starts, t) - 1
            if i < 0:
                return 0.0
            return self.compute_cum[i] + min(t - self.compute_starts[i], self.compute_durs[i])

        for key, begin, end in self.windows:
            self.per_instr[key]["overlapped_compute_s"] += busy_until(end) - busy_until(begin)

        step = max(self.tc, self.t_out, self.t_in, self.t_copy)
        exposed_total = sum(self.exposed_by_axis.values())
        return SimResult(
            step_time_s=step, compute_s=self.compute_busy, comm_s=self.comm_busy, exposed_comm_s=exposed_total,
            exposed_by_axis=dict(self.exposed_by_axis), comm_by_axis=self.comm_by_axis,
            compute_idle_fraction=1 - self.compute_busy / step if step > 0 else 0.0,
            # a send and a recv overlap on full-duplex links, so comm time can exceed the step
            comm_idle_fraction=max(0.0, 1 - self.comm_busy / step) if step > 0 else 0.0,
            flops_per_device=schedule.flops,
            collectives=sorted(self.per_instr.values(), key=lambda c: -c["time_s"]),
            timeline=self.timeline, copy_s=self.copy_busy, exposed_copy_s=self.exposed_copy)


# Op kind (see `xlaopt.analysis.schedule.Op`) -> its handler; "free" ops take no time.
_HANDLERS = {
    "compute": _Run.compute,
    "collective": _Run.collective,
    "collective-start": _Run.collective_start,
    "collective-done": _Run.collective_done,
    "send": _Run.send,
    "recv": _Run.recv,
    "send-done": _Run.transfer_done,
    "recv-done": _Run.transfer_done,
    "copy-start": _Run.copy_start,
    "copy-done": _Run.copy_done,
}


def simulate(schedule: Schedule, topology: Topology, mesh_shape: dict[str, int] | None = None,
             eff: costmodel.Efficiency = costmodel.FITTED, matmul_dtype: str | None = None,
             cpu_fixups: bool = False, keep_timeline: bool = True, kernels: bool = False) -> SimResult:
    """Run the schedule's ops through the compute, communication and copy streams (`kernels`: the
    program was compiled with XLA's all-reduce kernels on, `hlo_collective_time_s`)."""
    run = _Run(topology, mesh_shape, eff, matmul_dtype, cpu_fixups, keep_timeline, kernels)
    spans = {loop["name"]: loop["ops"] for loop in schedule.loops if "ops" in loop}
    branches = schedule.branch_spans
    marks = {i for span in [*spans.values(), *(r for runs in branches.values() for r in runs)] for i in span}
    clock: dict[int, float] = {}
    for i, op in enumerate(schedule.ops):
        if i in marks:
            clock[i] = run.tc
        handler = _HANDLERS.get(op.kind)
        if handler is not None:
            handler(run, op)
    clock[len(schedule.ops)] = run.tc
    result = run.result(schedule)
    result.loop_time_s = {name: clock.get(end, run.tc) - clock.get(first, run.tc) for name, (first, end) in spans.items()}
    result.branch_time_s = {tag: sum(clock[end] - clock[first] for first, end in runs) for tag, runs in branches.items()}
    return result


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
    tids = {"compute": 1, "wait": 2, "comm": 3, "copy": 4}
    labels = {"compute": "compute stream", "wait": "compute blocked on communication", "comm": "communication stream",
              "copy": "copy stream (async copies)"}
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


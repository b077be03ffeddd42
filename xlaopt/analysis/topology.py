"""Cluster topologies: devices, nodes, and the link levels a collective can cross.

A topology is `nodes` nodes of `devices_per_node` identical devices. Link levels run from
the innermost (inside a node) outwards; a collective is priced on the outermost level its
group spans. Bandwidths are per device and per direction, in bytes/s.

On the command line a topology is `PRESET:NODESxDEVICES_PER_NODE` (`h100:16x8`) or the path
of a TOML or JSON file with the fields of `Topology` (see `from_dict`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import tomllib

from xlaopt.errors import UserError


class TopologyError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_flops: dict  # dtype name -> dense FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float

    @property
    def has_fp8(self) -> bool:
        """Whether it multiplies fp8 matrices (an fp8 peak: Hopper and newer)."""
        return "float8" in self.peak_flops


@dataclasses.dataclass(frozen=True)
class LinkLevel:
    name: str
    bytes_per_s: float  # per device, per direction
    latency_s: float  # per collective step


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    device: Device
    nodes: int
    devices_per_node: int
    levels: tuple[LinkLevel, ...]  # innermost first: levels[0] inside a node, levels[-1] between nodes
    # Device index (node-major) of each logical device a compiled program numbers, when a mesh's
    # order (`MeshSpec.placement`) puts them elsewhere than in sequence; None: in sequence.
    placement: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise TopologyError(f"topology {self.name}: nodes and devices_per_node must be >= 1")
        if not self.levels:
            raise TopologyError(f"topology {self.name}: needs at least one link level")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        """The node of a logical device (as a compiled program's replica groups number them)."""
        return (device if self.placement is None else self.placement[device]) // self.devices_per_node

    def placed(self, placement: tuple[int, ...] | None) -> "Topology":
        """This topology with logical devices placed as `placement` says (identity: unplaced)."""
        if placement is not None and tuple(placement) == tuple(range(len(placement))):
            placement = None
        return dataclasses.replace(self, placement=None if placement is None else tuple(placement))

    def level_of(self, device_indices) -> LinkLevel:
        """The outermost link level a group of logical devices spans."""
        nodes = {self.node_of(i) for i in device_indices}
        return self.levels[0] if len(nodes) <= 1 else self.levels[-1]


# --- presets -------------------------------------------------------------------------------
# Sources: NVIDIA H100 / H200 / A100 / GB200 NVL72 datasheets (dense Tensor Core peaks, HBM
# size and bandwidth, NVLink bandwidth: the datasheets quote bidirectional totals, halved
# here to per-direction), ConnectX-7 400 Gb/s and HDR 200 Gb/s per GPU for the scale-out
# fabric (DGX H100/H200 and DGX A100 reference architectures). Latencies are not on any
# datasheet: they are typical NCCL per-step latencies (a few us on NVLink, ~10 us across
# InfiniBand) and are among the parameters the cost model calibrates.
_GBps, _TFLOPs = 1e9, 1e12

# TF32 (the tensor cores' f32, what XLA runs an f32 matmul in at default precision) is half the
# bf16 dense peak on each of these, as their datasheets list it (H100 SXM 494.7 TFLOP/s, A100 156).
_DEVICES = {
    "h100": Device("H100 SXM", {"bfloat16": 989 * _TFLOPs, "float16": 989 * _TFLOPs, "float8": 1979 * _TFLOPs,
                                "float32": 67 * _TFLOPs, "tfloat32": 495 * _TFLOPs}, 80e9, 3.35e12),
    "h200": Device("H200 SXM", {"bfloat16": 989 * _TFLOPs, "float16": 989 * _TFLOPs, "float8": 1979 * _TFLOPs,
                                "float32": 67 * _TFLOPs, "tfloat32": 495 * _TFLOPs}, 141e9, 4.8e12),
    "a100": Device("A100 SXM 80GB", {"bfloat16": 312 * _TFLOPs, "float16": 312 * _TFLOPs,
                                     "float32": 19.5 * _TFLOPs, "tfloat32": 156 * _TFLOPs}, 80e9, 2.039e12),
    # H100 96 GB HBM2e at its default 500 W limit (Meta Grand Teton, the TorchTitan benchmarks):
    # 96 GB and 2.4 TB/s from pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md,
    # which says its peak "is between SXM and NVL" without a figure. Assumed: the midpoint of the
    # H100 SXM (989 TFLOP/s bf16 dense) and H100 NVL (835 TFLOP/s, NVL datasheet) peaks, fp8 twice that.
    "h100gt": Device("H100 96GB HBM2e 500W", {"bfloat16": 912 * _TFLOPs, "float16": 912 * _TFLOPs,
                                              "float8": 1824 * _TFLOPs, "float32": 62 * _TFLOPs,
                                              "tfloat32": 456 * _TFLOPs}, 96e9, 2.4e12),
    # GB200 NVL72: 180 PFLOP/s bf16 dense and 13.4 TB HBM3e over 72 GPUs; 8 TB/s per GPU.
    "gb200": Device("B200 (GB200 NVL72)", {"bfloat16": 2500 * _TFLOPs, "float16": 2500 * _TFLOPs,
                                           "float8": 5000 * _TFLOPs, "float32": 80 * _TFLOPs,
                                           "tfloat32": 1250 * _TFLOPs}, 186e9, 8e12),
    # HGX / DGX B200 at 1,000 W (NVIDIA's HGX B200 figures, dense): 2,250 TFLOP/s bf16, 4,500 fp8;
    # 180 GB (DGX B200: 1,440 GB over 8 GPUs), 8 TB/s.
    "b200": Device("B200 (HGX/DGX)", {"bfloat16": 2250 * _TFLOPs, "float16": 2250 * _TFLOPs,
                                      "float8": 4500 * _TFLOPs, "float32": 80 * _TFLOPs,
                                      "tfloat32": 1125 * _TFLOPs}, 180e9, 8e12),
}
_LEVELS = {
    "h100": (LinkLevel("nvlink4", 450 * _GBps, 3e-6), LinkLevel("ib-400g", 50 * _GBps, 10e-6)),
    "h200": (LinkLevel("nvlink4", 450 * _GBps, 3e-6), LinkLevel("ib-400g", 50 * _GBps, 10e-6)),
    "a100": (LinkLevel("nvlink3", 300 * _GBps, 3e-6), LinkLevel("ib-200g", 25 * _GBps, 10e-6)),
    # Grand Teton: 8 GPUs fully connected with NVLink (NVLink 4, as on SXM), 400 Gb/s RDMA per GPU
    # (same torchtitan benchmark page).
    "h100gt": (LinkLevel("nvlink4", 450 * _GBps, 3e-6), LinkLevel("rdma-400g", 50 * _GBps, 10e-6)),
    "gb200": (LinkLevel("nvlink5", 900 * _GBps, 3e-6), LinkLevel("ib-400g", 50 * _GBps, 10e-6)),
    "b200": (LinkLevel("nvlink5", 900 * _GBps, 3e-6), LinkLevel("ib-400g", 50 * _GBps, 10e-6)),
}
_DEFAULT_SHAPE = {"h100": (1, 8), "h100gt": (1, 8), "h200": (1, 8), "a100": (1, 8), "gb200": (1, 72), "b200": (1, 8)}
PRESETS = tuple(_DEVICES) + ("cpu",)


def device_for_kind(kind: str) -> Device | None:
    """The preset device whose name a JAX `device_kind` (e.g. "NVIDIA H100 80GB HBM3") names."""
    for key, device in _DEVICES.items():
        if key in kind.lower():
            return device
    return None


def preset(name: str, nodes: int | None = None, devices_per_node: int | None = None) -> Topology:
    if name == "cpu":
        dpn = 8 if devices_per_node is None else devices_per_node
        if nodes not in (None, 1):  # it used to be taken as one node of devices_per_node, silently
            _check_shape(f"cpu:{nodes}x{dpn}", nodes, dpn)
            raise TopologyError(f"cpu:{nodes}x{dpn}: the simulated CPU devices are one host, so the cpu "
                                f"preset has one node (cpu:1x{nodes * dpn}); for a cluster's "
                                f"nodes give its preset, e.g. h100:{nodes}x{dpn}")
        _check_shape(f"cpu:1x{dpn}", 1, dpn)
        return cpu_simulation(dpn)
    if name not in _DEVICES:
        raise TopologyError(f"unknown topology preset {name!r}; presets: {', '.join(PRESETS)} "
                            f"(or give a TOML/JSON file)")
    default_nodes, default_dpn = _DEFAULT_SHAPE[name]
    # `is None`, not `or`: h100:0x8 used to become h100:1x8 silently.
    nodes = default_nodes if nodes is None else nodes
    dpn = default_dpn if devices_per_node is None else devices_per_node
    _check_shape(f"{name}:{nodes}x{dpn}", nodes, dpn)
    if name == "gb200" and dpn > 72:
        raise TopologyError(f"gb200: an NVL72 domain holds at most 72 GPUs, not {dpn}")
    return Topology(f"{name}:{nodes}x{dpn}", _DEVICES[name], nodes, dpn, _LEVELS[name])


# More devices than any cluster has (131,072): beyond it a spec is a typo such as h100:100000x8,
# whose global batch alone would not fit in host memory.
MAX_DEVICES = 1 << 17


def _check_shape(spec: str, nodes: int, devices_per_node: int) -> None:
    if nodes < 1 or devices_per_node < 1:
        raise TopologyError(f"topology {spec}: nodes and devices per node must be at least 1, e.g. h100:2x8")
    if nodes * devices_per_node > MAX_DEVICES:
        raise TopologyError(f"topology {spec}: {nodes * devices_per_node} devices; at most {MAX_DEVICES} are "
                            f"supported (a typo in NODESxDEVICES?)")


SIMULATED_CPU = "simulated CPU device"


def cpu_simulation(devices: int, host_flops: float | None = None) -> Topology:
    """Simulated CPU devices: one node, one level (host memory copies). The host's measured
    matmul peak is shared by all simulated devices."""
    if host_flops is None:
        from xlaopt.analysis.cpu_peak import measure_cpu_matmul_peak

        host_flops = measure_cpu_matmul_peak("float32")
    per_device = host_flops / devices
    # analyze prices a CPU compile's matmuls at the compute dtype's peak; the one measured peak
    # stands for every compute dtype, so a --dtype never falls through to another's figure.
    device = Device(SIMULATED_CPU, {"float32": per_device, "bfloat16": per_device, "float16": per_device},
                    0.0, 10e9)
    return Topology(f"cpu:1x{devices}", device, 1, devices, (LinkLevel("host-memory", 10e9, 1e-6),))


_SPEC = re.compile(r"^(?P<name>[a-z0-9]+)(:(?P<nodes>\d+)x(?P<dpn>\d+))?$")


def preset_shape(text: str) -> tuple[str, int] | None:
    """(preset name, device count) of a `PRESET[:NODESxDEVICES]` spec, without building it (a CPU
    topology measures the host, which starts JAX's backend: callers that must first set the
    simulated device count ask here); None for a file."""
    m = _SPEC.match(text.strip())
    if not m or pathlib.Path(text).exists() or (m.group("name") not in _DEVICES and m.group("name") != "cpu"):
        return None
    name = m.group("name")
    if m.group("nodes"):
        return name, int(m.group("nodes")) * int(m.group("dpn"))
    nodes, dpn = _DEFAULT_SHAPE.get(name, (1, 8))
    return name, nodes * dpn


def parse_topology(text: str) -> Topology:
    """`h100:16x8`, `gb200:1x72`, `cpu:1x8`, or a path to a TOML / JSON topology file."""
    m = _SPEC.match(text.strip())
    if m and not pathlib.Path(text).exists():
        nodes, dpn = m.group("nodes"), m.group("dpn")
        return preset(m.group("name"), int(nodes) if nodes else None, int(dpn) if dpn else None)
    path = pathlib.Path(text)
    if not path.is_file():
        raise TopologyError(f"topology {text!r} is neither PRESET:NODESxDEVICES (presets: {', '.join(PRESETS)}) "
                            f"nor an existing TOML/JSON file")
    try:
        data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TopologyError(f"topology file {path}: cannot parse: {e}") from None
    except OSError as e:
        raise TopologyError(f"topology file {path}: cannot read: {e.strerror}") from None
    return from_dict(data, str(path))


def from_dict(data: dict, where: str = "topology") -> Topology:
    """Build a topology from plain data:
    {name, nodes, devices_per_node,
     device: {name, peak_flops: {dtype: FLOP/s}, hbm_bytes, hbm_bytes_per_s},
     levels: [{name, bytes_per_s, latency_s}, ...]  (innermost first)}
    Every count is a whole number and every rate a finite number: a zero bandwidth divided the
    prices by zero, a fractional node count was truncated, NaN priced every step as NaN."""
    def need(obj: dict, key: str, ctx: str):
        if not isinstance(obj, dict) or key not in obj:
            raise TopologyError(f"{where}: missing field {ctx}{key}")
        return obj[key]

    def count(obj: dict, key: str) -> int:
        value = need(obj, key, "")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"{where}: {key} = {value!r} must be a whole number >= 1")
        return value

    def number(obj: dict, key: str, ctx: str, positive: bool = True) -> float:
        value = need(obj, key, ctx)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (positive and value == 0):
            raise TopologyError(f"{where}: {ctx}{key} = {value!r} must be a finite number "
                                f"{'> 0' if positive else '>= 0'}")
        return float(value)

    device = need(data, "device", "")
    levels = need(data, "levels", "")
    if not isinstance(levels, list) or not levels:
        raise TopologyError(f"{where}: levels must be a non-empty list, innermost first")
    peaks = need(device, "peak_flops", "device.")
    if not isinstance(peaks, dict) or "bfloat16" not in peaks:
        raise TopologyError(f"{where}: device.peak_flops must be a table of dtype = FLOP/s with a bfloat16 entry "
                            f"(the price of every matmul starts from it), e.g. {{ bfloat16 = 989e12 }}")
    name = data.get("name", where)
    if not isinstance(name, str):
        raise TopologyError(f"{where}: name = {name!r} must be a string")
    nodes, per_node = count(data, "nodes"), count(data, "devices_per_node")
    _check_shape(where, nodes, per_node)
    return Topology(
        name=name,
        device=Device(str(need(device, "name", "device.")),
                      {dtype: number(peaks, dtype, "device.peak_flops.") for dtype in peaks},
                      number(device, "hbm_bytes", "device.", positive=False),
                      number(device, "hbm_bytes_per_s", "device.")),
        nodes=nodes, devices_per_node=per_node,
        levels=tuple(LinkLevel(str(need(level, "name", f"levels[{i}].")),
                               number(level, "bytes_per_s", f"levels[{i}]."),
                               number(level, "latency_s", f"levels[{i}].", positive=False))
                     for i, level in enumerate(levels)))

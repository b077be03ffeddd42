"""Peak FLOP/s of the device a program ran on, for MFU.

GPUs use their published dense peak (the topology presets, with their sources). A CPU has
no useful datasheet figure for XLA's code, so its peak is measured: the best of several
large matmuls in the compute dtype on one device, which XLA spreads over all host cores.
Simulated CPU devices share those cores, so a CPU mesh's peak is the host's, however many
devices it simulates.
"""
from __future__ import annotations

import dataclasses

from xlaopt.analysis.cpu_peak import measure_cpu_matmul_peak


@dataclasses.dataclass(frozen=True)
class Peak:
    flops_per_s: float  # for the whole mesh
    source: str


def mesh_peak(devices, dtype: str) -> Peak:
    """Aggregate peak FLOP/s of `devices` in `dtype`."""
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        per_host = measure_cpu_matmul_peak(dtype)
        return Peak(per_host, f"measured {dtype} matmul peak of the host CPU ({per_host / 1e9:.1f} GFLOP/s), "
                              f"shared by {len(devices)} simulated devices")
    from xlaopt.analysis.topology import device_for_kind

    device = device_for_kind(kind)
    if device is None or dtype not in device.peak_flops:
        raise ValueError(f"no {dtype} peak FLOP/s known for device kind {kind!r}; "
                         f"add it to xlaopt/analysis/topology.py")
    return Peak(device.peak_flops[dtype] * len(devices),
                f"{device.name} datasheet {dtype} dense peak x {len(devices)} devices")

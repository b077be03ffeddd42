"""Peak FLOP/s of the device a program ran on, for MFU.

GPUs use their published dense peak. A CPU has no useful datasheet figure for XLA's
code, so its peak is measured: the best of several large matmuls in the compute dtype on
one device, which XLA spreads over all host cores. Simulated CPU devices share those
cores, so a CPU mesh's peak is the host's, however many devices it simulates.
"""
from __future__ import annotations

import dataclasses
import functools
import time

# Dense (no sparsity) peaks from the vendors' datasheets, FLOP/s.
GPU_PEAKS = {
    "H100": {"bfloat16": 989e12, "float32": 67e12},  # NVIDIA H100 SXM datasheet
    "H200": {"bfloat16": 989e12, "float32": 67e12},  # NVIDIA H200 SXM datasheet
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},  # NVIDIA A100 SXM datasheet
}


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
    for name, peaks in GPU_PEAKS.items():
        if name in kind:
            return Peak(peaks[dtype] * len(devices), f"{name} datasheet {dtype} dense peak x {len(devices)} devices")
    raise ValueError(f"no peak FLOP/s known for device kind {kind!r}; add it to GPU_PEAKS")


@functools.lru_cache(maxsize=4)
def measure_cpu_matmul_peak(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best

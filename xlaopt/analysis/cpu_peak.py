"""The host CPU's matmul peak, measured: XLA's CPU code has no useful datasheet figure."""
from __future__ import annotations

import functools
import time


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


@functools.lru_cache(maxsize=1)
def measure_cpu_efficiency(dtype: str = "float32"):
    """The cost model's efficiencies for simulated CPU devices, measured on this host: large
    matmuls reach the measured peak by definition (matmul_max 1); `matmul_half_flops` from a
    128^3 matmul's measured fraction of that peak (the FLOPs at which a matmul would reach half,
    on the model's curve e = f / (f + half)); attention is dense matmuls and softmax on the
    CPU, priced at that small matmul's fraction; copies between simulated devices are memory
    copies, at the link's full rate (nvlink = network = 1)."""
    from xlaopt.analysis.costmodel import Efficiency

    peak = measure_cpu_matmul_peak(dtype)
    n = 128
    small = measure_cpu_matmul_peak(dtype, n=n, repeats=20)
    fraction = min(small / peak, 1.0)
    flops = 2 * n**3
    half = flops * (1 / fraction - 1)
    return Efficiency(matmul_max=1.0, matmul_max_ampere=1.0, matmul_half_flops=half, attention=max(fraction, 1e-3),
                      nvlink=1.0, network=1.0)

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
def measure_small_matmul_fraction(dtype: str = "float32", n: int = 128) -> tuple[float, float]:
    """(FLOPs of an n^3 matmul, the fraction of the host's measured peak it reaches)."""
    peak = measure_cpu_matmul_peak(dtype)
    small = measure_cpu_matmul_peak(dtype, n=n, repeats=20)
    return 2.0 * n**3, min(small / peak, 1.0)

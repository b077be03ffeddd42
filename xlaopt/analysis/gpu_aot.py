"""Compile for NVIDIA GPUs on a machine without one (the optional `xlaopt[gpu-aot]` extra).

With `jax-cuda12-plugin` and `jax-cuda12-pjrt` 0.10.2 installed, JAX can describe a GPU cluster
without touching a GPU: `jax.experimental.topologies.get_topology_desc(name, "cuda",
target_config=<GpuTargetConfigProto text>, topology="SLICESxHOSTSxGPUS")` returns compile-only
devices, a mesh over them lowers and compiles as usual, and `compiled.as_text()` holds XLA's GPU
schedule (latency hiding scheduler, async collective start/done pairs). JAX's own backend must
stay on the CPU (`jax_platforms=cpu`) so the plugin never looks for a driver.

The target configs below are written from public specifications (NVIDIA datasheets and the CUDA
programming guide's per-compute-capability limits: 1024 threads per block, 2048 threads and 64K
registers per SM, 227 KB opt-in shared memory per block on Hopper, 163 KB on Ampere); field names
follow XLA's `stream_executor.GpuTargetConfigProto` (xla/stream_executor/device_description.proto).
"""
from __future__ import annotations

import functools

from xlaopt.analysis.topology import Topology
from xlaopt.errors import UserError

# (compute capability, SMs, boost clock GHz, HBM bytes/s, HBM bytes, L2 bytes, smem per SM,
#  smem per block opt-in, device name)
_SPECS = {
    # H100 SXM5 80GB: 132 SMs, 1.98 GHz boost, 3.35 TB/s HBM3, 50 MB L2, 228 KB shared memory per SM.
    "h100": ((9, 0), 132, 1.98, 3_350_000_000_000, 80 * 2**30, 50 * 2**20, 233472, 232448, "NVIDIA H100 80GB HBM3"),
    # H100 96GB (Grand Teton, 500 W): the same GH100 die; bandwidth from the torchtitan page cited in topology.py.
    "h100gt": ((9, 0), 132, 1.98, 2_400_000_000_000, 96 * 2**30, 50 * 2**20, 233472, 232448, "NVIDIA H100 96GB HBM2e"),
    # H200 SXM 141GB: GH100 die with 4.8 TB/s HBM3e.
    "h200": ((9, 0), 132, 1.98, 4_800_000_000_000, 141 * 10**9, 50 * 2**20, 233472, 232448, "NVIDIA H200"),
    # B200 (HGX/DGX, 1,000 W): 148 SMs (two dies of 74), 8 TB/s HBM3e and 180 GB as topology.py's
    # preset; the 1.965 GHz boost and 126 MB L2 are as commonly reported, not from a datasheet
    # (XLA reads them for fusion and tiling choices, not for time); Hopper's 228 KB shared memory per SM.
    "b200": ((10, 0), 148, 1.965, 8_000_000_000_000, 180 * 10**9, 126 * 2**20, 233472, 232448, "NVIDIA B200"),
    # A100 SXM 80GB: 108 SMs, 1.41 GHz boost, 2.039 TB/s HBM2e, 40 MB L2, 164 KB shared memory per SM.
    "a100": ((8, 0), 108, 1.41, 2_039_000_000_000, 80 * 2**30, 40 * 2**20, 167936, 166912, "NVIDIA A100-SXM4-80GB"),
}


def device_key(topology: Topology) -> str:
    """The target-config key for a topology's device (preset prefix, else the device name)."""
    prefix = topology.name.split(":", 1)[0]
    if prefix in _SPECS:
        return prefix
    for key in ("h200", "h100", "b200", "a100"):
        if key in topology.device.name.lower():
            return key
    raise UserError(f"--target gpu: no GPU target config for {topology.device.name!r} (topology "
                    f"{topology.name}); GPU targets: {', '.join(sorted(_SPECS))}")


def target_config(key: str) -> str:
    """GpuTargetConfigProto text for one of the known devices."""
    (major, minor), sms, ghz, bandwidth, memory, l2, smem_sm, smem_optin, name = _SPECS[key]
    return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {smem_optin}
  shared_memory_per_core: {smem_sm}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {ghz}
  device_memory_size: {memory}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""


def available() -> bool:
    try:
        import jax_cuda12_plugin  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=8)
def topology_devices(key: str, nodes: int, devices_per_node: int) -> tuple:
    """Compile-only devices of `nodes` hosts of `devices_per_node` GPUs, host-major."""
    if not available():
        raise UserError("--target gpu needs the gpu-aot extra: pip install 'xlaopt[gpu-aot]' "
                        "(jax-cuda12-plugin and jax-cuda12-pjrt 0.10.2)")
    import jax
    from jax.experimental import topologies

    try:
        jax.config.update("jax_platforms", "cpu")  # never look for a CUDA driver
    except RuntimeError:
        pass
    desc = topologies.get_topology_desc(key, "cuda", target_config=target_config(key),
                                        topology=f"1x{nodes}x{devices_per_node}")
    return tuple(desc.devices)


def gpu_mesh(topology: Topology, mesh_sizes: tuple[int, ...], axis_names: tuple[str, ...],
             placement: tuple[int, ...] | None = None):
    """A jax Mesh over the first prod(mesh_sizes) compile-only GPUs of `topology`; `placement`
    (`MeshSpec.placement()`) says which device each row-major mesh position takes."""
    import math

    import jax
    import numpy as np
    from jax.sharding import AxisType

    devices = topology_devices(device_key(topology), topology.nodes, topology.devices_per_node)
    n = math.prod(mesh_sizes)
    chosen = np.array(devices[:n], dtype=object)
    if placement is not None:
        chosen = chosen[list(placement)]
    return jax.sharding.Mesh(chosen.reshape(mesh_sizes), axis_names, axis_types=(AxisType.Auto,) * len(axis_names))

"""Joining a multi-process job through JAX's own runtime (`jax.distributed`).

A job is N processes, one per host on a cluster or several on one machine, each owning its
local devices; together they form the global mesh. On CPU the cross-process collectives go
over gloo (XLA's CPU pipeline has no other), on GPU over NCCL. The coordinator is process
0's address; every process is told it, the process count and its own id, as `torchrun` or
SLURM would tell it.
"""
from __future__ import annotations

from xlaopt.errors import UserError

INIT_TIMEOUT_S = 120


class DistributedError(UserError):
    pass


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Whether the three flags ask for a multi-process job; all three or none."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if not any(given):
        return False
    if not all(given):
        raise DistributedError("a multi-process job needs --coordinator HOST:PORT, --num-processes N and "
                               "--process-id I together (process 0 listens on the coordinator address)")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id {process_id} with --num-processes {num_processes}: "
                               f"need 0 <= id < N")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"--coordinator {coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    return True


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the job; must run before JAX initialises its backends."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Process 0's coordination service would otherwise listen on [::]:PORT, every interface, and
    # it authenticates nobody: bind it to the address the job was given (loopback for a local job).
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=INIT_TIMEOUT_S, coordinator_bind_address=coordinator)


def local_device_count(mesh_devices: int, num_processes: int) -> int:
    """Devices each process must bring for a mesh of `mesh_devices` (simulated CPU devices)."""
    if mesh_devices % num_processes:
        raise DistributedError(f"a mesh of {mesh_devices} devices does not split over {num_processes} processes; "
                               f"pick a mesh whose device count is a multiple of the process count")
    return mesh_devices // num_processes

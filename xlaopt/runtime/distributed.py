"""Joining a multi-process job through JAX's own runtime (`jax.distributed`).

A job is N processes, one per host on a cluster or several on one machine, each owning its
local devices; together they form the global mesh. On CPU the cross-process collectives go
over gloo (XLA's CPU pipeline has no other), on GPU over NCCL. The coordinator is process
0's address; every process is told it, the process count and its own id, as `torchrun` or
SLURM would tell it.
"""
from __future__ import annotations

import socket
import sys
import time

from xlaopt.errors import UserError
from xlaopt.runtime.faults import DEFAULT_PEER_TIMEOUT_S

INIT_TIMEOUT_S = 120
# JAX's own heartbeat check aborts every process from C++ (a stack trace, exit 134) once a peer
# has missed heartbeats for its timeout; our watchdog (xlaopt.runtime.faults) must report first
# and clearly, JAX's stays the backstop. A client beats only every so often, so the service can
# call a peer dead well before the timeout has passed since it died: with a 40 s timeout it
# aborted survivors ahead of a 30 s watchdog (tests/test_faults.py). Twice ours, plus a margin.
HEARTBEAT_MARGIN_S = 10


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


def initialize(coordinator: str, num_processes: int, process_id: int,
               peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
    """Join the job; must run before JAX initialises its backends."""
    import jax

    if process_id == 0:
        check_port_free(coordinator)
    else:
        wait_for_coordinator(coordinator, INIT_TIMEOUT_S)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Process 0's coordination service would otherwise listen on [::]:PORT, every interface, and
    # it authenticates nobody: bind it to the address the job was given (loopback for a local job).
    # A process whose peers are gone waits at most the shutdown timeout on its way out.
    timeout = 2 * int(peer_timeout_s) + HEARTBEAT_MARGIN_S
    # Tried and refused: the client factory's `missed_heartbeat_callback`, to replace JAX's C++
    # abort with our one-line report, throws std::bad_cast on jax 0.10.2 (no caster for the
    # status it passes), so a lost process 0 still ends its peers from C++, within a second.
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=INIT_TIMEOUT_S, coordinator_bind_address=coordinator,
                               heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout)


def joined() -> bool:
    """Whether this process has joined a multi-process job."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed

    return distributed.global_state.client is not None


def client():
    """The job's coordination-service client (key-value store, barriers)."""
    from jax._src import distributed  # JAX has no public handle on it

    return distributed.global_state.client


def check_port_free(address: str) -> None:
    """Refuse a coordinator address this machine cannot listen on, before JAX tries to: JAX
    would log the bind failure from C++ and wait out its start-up timeout."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DistributedError(f"--coordinator {address}: cannot resolve {host!r} ({e.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As gRPC's own listener does: a port left in TIME_WAIT by an earlier job is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            raise DistributedError(f"--coordinator {address}: process 0 cannot listen there ({e.strerror}); "
                                   f"pick a free port (another job may hold this one) or an address of this "
                                   f"host") from None


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Until process 0's coordination service accepts connections. JAX's client connects through
    gRPC, which, refused once, tries again only after its reconnect backoff (a second, growing
    to two minutes): a process forked a few milliseconds before process 0 listened waited a whole
    second to join (a third of restarts here, BENCHMARKS.md, issue 31)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(f"--coordinator {address}: process 0 did not listen there within "
                                       f"{timeout_s:g} s ({e.strerror or e}); start it, or check the address") from None
            time.sleep(0.005)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a local job's coordinator."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_device_count(mesh_devices: int, num_processes: int) -> int:
    """Devices each process must bring for a mesh of `mesh_devices` (simulated CPU devices)."""
    if mesh_devices % num_processes:
        raise DistributedError(f"a mesh of {mesh_devices} devices does not split over {num_processes} processes; "
                               f"pick a mesh whose device count is a multiple of the process count")
    return mesh_devices // num_processes

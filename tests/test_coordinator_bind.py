"""The coordination service of a job listens only on the address it was given: JAX's default
binds [::]:PORT, every interface, with no authentication. Read from the kernel's table of
listening sockets while process 0 waits for its peer."""
import pathlib
import subprocess
import sys
import time

import pytest

from conftest import free_port

TCP_LISTEN = "0A"


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} print them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = pathlib.Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            host, _, hex_port = address.partition(":")
            if state == TCP_LISTEN and int(hex_port, 16) == port:
                found.add(host)
    return found


# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as the tables spell them (JAX's default listens on ::, all
# zeros: every interface).
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp")
def test_a_local_jobs_coordinator_listens_on_loopback_only():
    port = free_port()
    code = ("from xlaopt.runtime import distributed; "
            f"distributed.initialize('127.0.0.1:{port}', 2, 0)")  # waits for process 1, which never comes
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, seen = time.monotonic() + 60, set()
        while not seen and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            seen = _listening(port)
        assert seen, "the coordinator never listened"
        assert seen <= LOOPBACK, f"port {port} listens on {seen}, not only on loopback"
    finally:
        proc.kill()
        proc.wait()

"""The local checkpoint tier's inputs, checked before any JAX work (a launcher checks them before
it starts its processes): a node-local directory, and a peer count the job can meet."""
from __future__ import annotations

import pathlib

from xlaopt.errors import UserError
from xlaopt.io.outputs import make_writable_directory

NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
                       "9p", "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.juicefs", "afs"}


def check_peers(peers: int, processes: int) -> None:
    if peers < 0:
        raise UserError(f"--local-peers {peers}: a count of peer processes, 0 or more")
    if processes == 1 and peers:
        raise UserError(f"--local-peers {peers}: a job of one process has no peer to copy its local tier to; "
                              f"give --local-peers 0 (and a persistent --ckpt for a node lost)")
    if peers >= processes > 1:
        raise UserError(f"--local-peers {peers}: the job has {processes} processes, so at most {processes - 1} "
                              f"other(s) can hold a copy; give --local-peers 1 to {processes - 1}")


def check_local(root, persistent) -> pathlib.Path:
    """`root` as a local tier: writable, and local (not a network filesystem, not inside the
    persistent tier's directory). A UserError naming the fix otherwise, before any work."""
    path = pathlib.Path(root).expanduser().absolute()
    if persistent is not None:
        ckpt = pathlib.Path(persistent).expanduser().absolute()
        if path == ckpt or path.is_relative_to(ckpt) or ckpt.is_relative_to(path):
            raise UserError(f"--local-ckpt {root}: it is, or overlaps, the persistent --ckpt {persistent}; "
                                  f"the local tier lives on each node's own disk (e.g. /dev/shm/JOB or /local/JOB)")
    fs = filesystem_type(path)
    if fs in NETWORK_FILESYSTEMS:
        raise UserError(f"--local-ckpt {root}: on a {fs} filesystem, shared over the network, not node-local; "
                              f"give a path on the node's own disk or /dev/shm")
    try:
        make_writable_directory(path)
    except OSError as e:
        raise UserError(f"--local-ckpt {root}: cannot write there ({e.strerror or e}); give a writable "
                              f"node-local directory") from None
    return path


def filesystem_type(path: pathlib.Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the filesystem holding `path` (its longest mount point in `mounts`); None if unknown."""
    try:
        table = pathlib.Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in table:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind

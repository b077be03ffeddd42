"""Output paths checked before a command does any work.

A run that compiles for minutes and trains for hours, then fails to open `--json` for writing,
has lost its results; so every output a command will write is checked first (`check_outputs`,
called by `xlaopt.cli.main` before any command starts). The check writes nothing the user
sees: an existing file is opened for update and closed unchanged, a new one's directory gets a
hidden probe file that is removed at once. Writing (not `os.access`) is the test because a root
process passes `os.access` on a read-only file system.
"""
from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Any, Mapping

from xlaopt.errors import UserError

FILE, DIRECTORY = "file", "directory"

# dest -> (flag, kind) of the outputs every command that has them writes.
_COMMON = {"json": ("--json", FILE), "trace": ("--trace", FILE), "dump": ("--dump", FILE),
           "dump_hlo": ("--dump-hlo", DIRECTORY), "ckpt": ("--ckpt", DIRECTORY)}
# Outputs whose dest another command uses for an input (`ckpt ls DIR` reads its DIR).
_BY_COMMAND = {"plan": {"out": ("--out", FILE)}, "import-weights": {"out": ("--out", DIRECTORY)},
               "data make": {"dir": ("DIR", DIRECTORY)}, "bench": {"dir": ("--dir", DIRECTORY)}}


def outputs(command: str, values: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(flag, path, kind) of each output that `values` (the flags' values by dest) of `command`
    (its words: `plan`, `data make`) name."""
    own = {}
    for name, dests in _BY_COMMAND.items():
        if command == name or command.startswith(name + " "):
            own = dests
    found = []
    for dest, (flag, kind) in {**_COMMON, **own}.items():
        path = values.get(dest)
        if isinstance(path, str) and path:  # unset, or "" (which `_write_json` skips)
            found.append((flag, path, kind))
    return found


def check_outputs(command: str, values: Mapping[str, Any]) -> None:
    for flag, path, kind in outputs(command, values):
        check_writable(path, flag, kind)


def check_writable(path: str | os.PathLike, flag: str, kind: str = FILE) -> None:
    """Raise a UserError naming `flag` unless `path` can be written as a `kind` (FILE: a file
    that may exist, in an existing directory; DIRECTORY: a directory that may exist, or be made
    with its missing parents)."""
    def refuse(why: str):
        return UserError(f"{flag} {path}: {why}; nothing was run")

    if "\0" in os.fspath(path):  # pathlib's checks answer False for it, the write would fail
        raise refuse("contains a NUL byte")
    try:
        path = pathlib.Path(path)
        if kind == FILE:
            if path.is_dir():
                raise refuse(f"is a directory; give a file name, e.g. {path / 'out.json'}")
            if path.exists():
                with open(path, "r+b"):  # opened for writing, not truncated
                    return
            directory = path.parent
            if not directory.is_dir():
                raise refuse(f"{directory} is not a directory" if directory.exists()
                             else f"directory {directory} does not exist; create it or write elsewhere")
        else:
            if path.exists() and not path.is_dir():
                raise refuse("is a file, not a directory")
            directory = path
            while not directory.exists():  # where the missing directories would be made
                directory = directory.parent
            if not directory.is_dir():
                raise refuse(f"{directory} is a file, so the directory cannot be made")
    except OSError as e:
        raise refuse(f"cannot be written ({e.strerror or e})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".xlaopt-write-check-", dir=directory)
    except OSError as e:
        raise refuse(f"cannot write in {directory} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def make_writable_directory(path: pathlib.Path) -> None:
    """Make `path` (with its parents) and write and remove a hidden probe in it; an OSError when it
    cannot be written, for the caller to name its flag and the fix."""
    path.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".xlaopt-write-check-", dir=path)
    os.close(fd)
    os.unlink(probe)

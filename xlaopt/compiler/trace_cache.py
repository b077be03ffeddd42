"""Results of tracing a model, kept on disk beside the compile cache (in its `traces/`), so that a
restarted process skips the trace: the layout pass's trace of the activations was 1.0 s of a
restart's 3 s start here (BENCHMARKS.md, issue 31).

An entry is JSON, never pickled, named by a hash of what the trace reads (the program's fields,
as their repr, which a frozen dataclass spells out in full) and of the code that traces it (the
installed xlaopt's sources, by path, size and modification time, and JAX's version): an edit to
either is another name, never a stale entry. A program whose repr names an object by its address
is not kept (its name would differ in every process). Off with the compile cache.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import uuid

from xlaopt.compiler import cache as compile_cache

_PACKAGES = ("xlaopt", "xlaopt.models", "xlaopt.passes")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The installed sources' paths, sizes and modification times, and JAX's version."""
    import jax

    digest = hashlib.sha256(jax.__version__.encode())
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in spec.submodule_search_locations or ():
            for path in sorted(pathlib.Path(root).rglob("*.py")):
                stat = path.stat()
                digest.update(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()


def _path(kind: str, key) -> pathlib.Path | None:
    directory = compile_cache.directory()
    text = repr(key)
    if directory is None or " at 0x" in text:
        return None
    name = hashlib.sha256(f"{kind}\n{text}\n{code_fingerprint()}".encode()).hexdigest()[:40]
    return directory / "traces" / f"{kind}-{name}.json"


def cached(kind: str, key, compute):
    """`compute()`'s result (JSON-able; lists come back as tuples) for `key`, from disk when an
    earlier process traced it; an unreadable entry is traced again and replaced."""
    path = _path(kind, key)
    if path is not None:
        try:
            return _tuples(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    value = compute()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)  # whole or absent: processes tracing at once each write it whole
    return value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value

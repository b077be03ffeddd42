"""JAX's persistent compilation cache, on by default for every command that compiles.

A restart after a fault, or a second `xlaopt train`, then loads the step's executable from disk
instead of compiling it again. The directory is `$XLAOPT_CACHE/jax-compile` (default
`~/.cache/xlaopt/jax-compile`), or the one `--compile-cache DIR` names; `--compile-cache off` turns
it off. Safe with HLO transforms: JAX's cache key covers the compile options, which carry each
transform's fingerprint (`xlaopt.compile`; tests/test_compile_cache.py).

What jax 0.10.2 does with a damaged entry (checked in tests/test_compile_cache.py): it warns
"Error reading persistent compilation cache entry ..." and compiles afresh, but never replaces the
entry (`LRUCache.put` skips a key that exists), so every later run would pay the compile and the
warning again. `reading_entries` watches a compile: it notes the keys JAX read (its lru_cache
logger names each hit at debug level), turns JAX's warning into one line of ours, and deletes the
damaged entry so that this compile's executable is written in its place.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import warnings

from xlaopt.errors import UserError
from xlaopt.io.outputs import make_writable_directory

OFF = "off"
# Compiles shorter than this are not written: jit's small helper programs would fill the directory
# with entries that take about as long to load as to compile.
MIN_COMPILE_TIME_S = 0.2
_READ_ERROR = "Error reading persistent compilation cache entry"
_CACHE_LOGGER = "jax._src.lru_cache"
_HIT = "Cache hit for key: "
_ENTRY_SUFFIX = "-cache"  # jax._src.lru_cache._CACHE_SUFFIX on 0.10.2

_directory: pathlib.Path | None = None


def default_directory() -> pathlib.Path:
    root = os.environ.get("XLAOPT_CACHE") or pathlib.Path.home() / ".cache" / "xlaopt"
    return pathlib.Path(root) / "jax-compile"


def check(setting: str | None) -> pathlib.Path | None:
    """The directory `setting` (a path, `off`, or None for the default) names, made and probed for
    writing; None when off. A directory that cannot be written is a UserError, before any work."""
    if setting == OFF:
        return None
    directory = pathlib.Path(setting).expanduser() if setting else default_directory()
    try:
        make_writable_directory(directory)
    except OSError as e:
        raise UserError(f"--compile-cache {directory}: cannot write there ({e.strerror or e}); give a writable "
                        f"directory, or --compile-cache off") from None
    return directory


def configure(setting: str | None = None) -> pathlib.Path | None:
    """Point JAX's persistent cache at `setting`'s directory (see `check`), or turn it off.
    Takes effect for the compiles after it, also when an earlier one ran without the cache."""
    global _directory
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    directory = check(setting)
    if directory == _directory and (directory is None) == (jax.config.jax_compilation_cache_dir is None):
        return directory
    jax.config.update("jax_compilation_cache_dir", None if directory is None else str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    # JAX decides once a process whether the cache is used, at its first compile: start again.
    compilation_cache.reset_cache()
    _directory = directory
    return directory


@contextlib.contextmanager
def unused():
    """No persistent cache around the compiles inside: for executables that cannot be read back.
    A deviceless (compile-only) GPU compile's entry fails to load on jax 0.10.2 ("PjRtCompiler must
    be constructed with a Client to call DeserializeLoadedExecutable"), and JAX never replaces an
    entry it could not read, so each identical compile after the first would warn again."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_compilation_cache_dir
    if was is None:
        yield
        return
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used: decide again
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", was)
        compilation_cache.reset_cache()


def directory() -> pathlib.Path | None:
    """The directory `configure` set, None when off or never configured."""
    return _directory


class _Hits(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.keys: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_HIT):
            self.keys.append(message[len(_HIT):].strip("'\""))


@contextlib.contextmanager
def reading_entries(what: str):
    """Around one compile: a damaged cache entry becomes one warning line and is removed before
    the compile's executable is written, so it takes the entry's place (see the module docstring).
    `what` names the compile in that line."""
    logger = logging.getLogger(_CACHE_LOGGER)
    hits, level, propagate = _Hits(), logger.level, logger.propagate

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.startswith(_READ_ERROR):
            return shown(message, category, filename, lineno, file, line)
        removed = _remove_entry(hits.keys[-1]) if hits.keys else None
        reason = (text.partition("': ")[2] or text).splitlines()[0][:160]
        print(f"xlaopt: warning: the compile cache's entry for {what} could not be read ({reason}); compiling "
              f"afresh{f', in place of {removed.name}' if removed else ''}", file=sys.stderr)

    logger.addHandler(hits)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the debug lines are ours to read, not to print
    try:
        with warnings.catch_warnings():
            shown = warnings.showwarning
            warnings.showwarning = show  # called as JAX warns, before it compiles and writes the entry
            yield
    finally:
        logger.removeHandler(hits)
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def written_by_every_process(platform: str):
    """Around one compile in a multi-process job on the CPU: this process writes its own entry.

    jax 0.10.2 writes entries from process 0 only (`jax._src.compiler._cache_write`), so that
    processes compiling one program under one key do not race to write it. On the CPU each
    process's key differs (it hashes the topology of the process's own devices), so process 1's
    executable was never written and every restart compiled it again: 2.0 s of a 3.5 s start on
    this 2-core host. With keys apart there is no race to avoid (tests/test_compile_cache.py: one
    entry a process, each read back by its process). JAX reads the writer's identity from `distributed.global_state.process_id`
    there alone; the compile runs on this thread while the id reads 0."""
    from jax._src import distributed  # JAX has no public switch for this

    state = distributed.global_state
    if platform != "cpu" or not state.process_id or _directory is None:
        yield
        return
    own, state.process_id = state.process_id, 0
    try:
        yield
    finally:
        state.process_id = own


def _remove_entry(key: str) -> pathlib.Path | None:
    if _directory is None:
        return None
    path = _directory / f"{key}{_ENTRY_SUFFIX}"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        return path
    return None

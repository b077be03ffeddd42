"""Compile once: equal programs share compiled executables in a process, JAX's persistent cache
carries them to the next process, and a damaged cache entry costs a compile, never a crash."""
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

from xlaopt.analysis import hlo
from xlaopt.compile import compile_program
from xlaopt.compiler import cache as compile_cache
from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec, mesh_over
from xlaopt.models.registry import get_config
from xlaopt.program import TrainProgram


def test_equal_programs_built_apart_share_one_compiled_program():
    one = TrainProgram(get_config("llama-tiny", {"num_layers": 1}), MeshSpec.parse("data=2"))
    again = TrainProgram(get_config("llama-tiny", {"num_layers": 1}), MeshSpec.parse("data=2"))
    assert one is not again and compile_program(one) is compile_program(again)
    assert compile_program(one) is not compile_program(one.replace(settings=one.settings.__class__(seed=1)))
    # Another mesh over other devices is another compile, even for an equal program.
    mesh = mesh_over(one.mesh, jax.devices()[4:6])
    assert compile_program(one, mesh) is not compile_program(one)
    assert compile_program(one, mesh) is compile_program(again, mesh)


def test_an_unwritable_directory_is_refused_before_any_work(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(UserError, match=r"--compile-cache .*file/jax: cannot write there .*--compile-cache off"):
        compile_cache.check(str(blocked / "jax"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UserError, match="cannot write there"):
            compile_cache.check(str(locked))
    assert compile_cache.check("off") is None
    assert compile_cache.check(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"


@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["analyze", "--topology", "h100:1x8"],
                                     ["plan", "--topology", "cpu:1x8"], ["generate"]])
def test_every_compiling_command_refuses_an_unwritable_cache_in_one_line_before_any_work(tmp_path, capsys, command):
    from xlaopt.cli import main

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    out = tmp_path / "out.json"
    argv = [command[0], "--model", "llama-tiny", *command[1:], "--compile-cache", str(blocked / "jax")]
    if command[0] != "plan" and command[0] != "generate":
        argv += ["--json", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot write there" in err and "--compile-cache off" in err, err
    assert not out.exists()
    assert compile_cache.directory() == compile_cache.default_directory()  # the run's cache is left as it was


# Each run in its own process: what a restarted job sees of the last one's cache.
_COMPILE = textwrap.dedent("""
    import sys, jax
    jax.config.update("jax_platforms", "cpu")
    from xlaopt.compiler import cache as compile_cache
    from xlaopt.compile import compile_program
    from xlaopt.models.registry import get_config
    from xlaopt.program import TrainProgram

    compile_cache.configure(sys.argv[1])
    print(compile_program(TrainProgram(get_config("llama-tiny", {"num_layers": 1}))).grads.as_text())
""")


def _compile_in_a_process(cache: pathlib.Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(cache)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def same_program(a: str, b: str) -> bool:
    return hlo.without_source_locations(a) == hlo.without_source_locations(b)


def _entries(cache: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in cache.glob("*-cache")}


@pytest.mark.slow
def test_a_damaged_entry_is_recompiled_with_one_warning_and_replaced(tmp_path):
    cache = tmp_path / "cache"
    first = _compile_in_a_process(cache)
    written = _entries(cache)
    assert written, "the persistent cache was not written"
    for name, data in written.items():  # a write cut short, as by a crash
        (cache / name).write_bytes(data[: len(data) // 2])
    damaged = _compile_in_a_process(cache)
    warned = [line for line in damaged.stderr.splitlines() if "compile cache" in line]
    assert len(warned) == 1 and "could not be read" in warned[0] and "compiling afresh" in warned[0], damaged.stderr
    assert "Error reading persistent compilation cache entry" not in damaged.stderr  # JAX's words, ours instead
    assert same_program(damaged.stdout, first.stdout)  # the same program, compiled afresh
    replaced = _entries(cache)  # whole entries in the damaged ones' place (their bytes hold the compile time)
    assert replaced.keys() == written.keys() and all(len(replaced[k]) > len(v) // 2 for k, v in written.items())
    again = _compile_in_a_process(cache)
    assert "compile cache" not in again.stderr and same_program(again.stdout, first.stdout)


# `xlaopt train` with JAX's own account of each compile's cache lookup (its compiler's debug log).
_TRAIN_LOGGING_LOOKUPS = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
    from xlaopt.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow  # two two-process jobs
def test_every_process_of_a_cpu_job_writes_and_then_reads_its_own_entry(tmp_path):
    """JAX writes entries from process 0 only; on the CPU each process's key differs (its topology
    fingerprint), so process 1 compiled afresh on every restart until it wrote its own."""
    from conftest import command_env, free_port

    cache = tmp_path / "cache"
    args = ["--model", "llama-tiny", "--set", "num_layers=1", "--set", "d_model=64", "--set", "vocab_size=256",
            "--mesh", "data=2", "--steps", "1", "--no-progress", "--compile-cache", cache]
    env = command_env(fast_compile=False)

    def job() -> list[str]:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-c", _TRAIN_LOGGING_LOOKUPS, "train", *map(str, args), "--coordinator",
                                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in (0, 1)]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
        return errs

    first = job()
    assert all("PERSISTENT COMPILATION CACHE MISS for 'jit_train_step'" in err for err in first)
    assert len(list(cache.glob("jit_train_step-*-cache"))) == 2  # one entry a process
    again = job()
    assert all("Persistent compilation cache hit for 'jit_train_step'" in err for err in again), again[1][-3000:]


def test_the_activation_trace_is_read_back_from_disk_equal_and_keyed_by_program(tmp_path, monkeypatch):
    from xlaopt import step
    from xlaopt.compiler import trace_cache

    monkeypatch.setattr(compile_cache, "_directory", tmp_path)
    program = TrainProgram(get_config("llama-tiny", {"num_layers": 1}), MeshSpec.parse("data=2,tensor=2"))
    traced = step._trace_activation_axes(program)
    assert trace_cache.cached("activations", program, lambda: step._trace_activation_axes(program)) == traced
    entries = list((tmp_path / "traces").glob("activations-*.json"))
    assert len(entries) == 1
    # Read back, not traced again: a compute that would fail is never called, and the value is equal.
    assert trace_cache.cached("activations", program, lambda: 1 / 0) == traced
    other = program.replace(mesh=MeshSpec.parse("data=4"))
    assert trace_cache.cached("activations", other, lambda: "traced") == "traced"  # another program, another entry
    entries[0].write_text("{damaged")
    assert trace_cache.cached("activations", program, lambda: step._trace_activation_axes(program)) == traced


def test_compiles_inside_unused_neither_read_nor_write_the_cache(tmp_path):
    """What the deviceless GPU compiles of `analyze --serve` run under (their entries cannot be read
    back on jax 0.10.2): outside it, the same compile writes its entry."""
    import jax.numpy as jnp

    before = compile_cache.directory()
    compile_cache.configure(str(tmp_path))
    try:
        saved_min = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        entries = lambda: {p.name for p in tmp_path.iterdir()}  # noqa: E731
        with compile_cache.unused():
            assert jax.config.jax_compilation_cache_dir is None
            jax.jit(lambda x: jnp.sin(x) * 3).lower(jnp.ones(7)).compile()
        assert entries() == set() and jax.config.jax_compilation_cache_dir == str(tmp_path)
        jax.jit(lambda x: jnp.sin(x) * 3).lower(jnp.ones(7)).compile()
        assert len(entries()) == 1
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved_min)
        compile_cache.configure(str(before) if before is not None else compile_cache.OFF)

"""How the suite compiles: for speed, while every compiled program a test reads is a user's.

Most of the suite's time is XLA:CPU compiling small programs that then run a step or two. Two
settings make that compile about 3x faster (a sharded cosmos3-tiny step: 4 s instead of 14 s;
docs/tests.md has the measurements):
- LLVM at -O0 (`--xla_backend_optimization_level=0`). XLA's HLO passes do not read it: the
  optimised, scheduled HLO is the default level's, line for line.
- XLA:CPU's elemental emitters instead of its MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`). These do change the HLO: fusion decides otherwise,
  and every scatter is expanded into a while loop.

So the suite executes the fast executable, but whatever reads one (`Compiled.as_text`,
`memory_analysis`, `cost_analysis`: the HLO tests, analyze's and the planner's prices) reads the
program compiled with the user's emitters instead, compiled from the same lowering on first read.
`test_hlo.py` checks that this is the HLO of a process without any XLA flags.

Commands the tests start in processes of their own compile fast too (`COMMAND_FLAGS`: both
flags) unless a test asks for a user's compile. Nothing redirects their reads, so no such process
may read a compiled program: they train, save, restore and compare numbers, never `analyze` or
`inspect` (those run in the suite's own processes).
"""
from __future__ import annotations

import functools

# Constants only at import: conftest puts the flags into XLA_FLAGS before JAX starts.
LLVM_O0 = "--xla_backend_optimization_level=0"
ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
COMMAND_FLAGS = f"{LLVM_O0} {ELEMENTAL_EMITTERS}"
# A per-compile option overrides XLA_FLAGS: this gives back a user's emitters for one compile.
USERS_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
_READS = ("as_text", "cost_analysis", "memory_analysis")
_original: dict = {}


def install() -> None:
    """Compile fast and read the user's compile, for every compile in this process."""
    import jax.stages

    from xlaopt.compile import HLO_TRANSFORM_MARKER

    lowered_compile = _original["compile"] = jax.stages.Lowered.compile
    _original.update((name, getattr(jax.stages.Compiled, name)) for name in _READS)

    def compile_fast_read_users(self, compiler_options=None, *, device_assignment=None):
        compiled = lowered_compile(self, compiler_options, device_assignment=device_assignment)
        if "cpu" not in self._lowering._platforms:  # a deviceless GPU compile: the flags are not its
            return compiled
        users = dict(compiler_options or {}, **USERS_EMITTERS)
        compiled._suite_users = functools.cache(
            lambda: lowered_compile(self, users, device_assignment=device_assignment))
        # An HLO transform is registered with XLA only while its program compiles (xlaopt.compile),
        # so its user compile cannot wait for a read.
        if HLO_TRANSFORM_MARKER in str(users.get("xla_disable_hlo_passes", "")):
            compiled._suite_users()
        return compiled

    jax.stages.Lowered.compile = compile_fast_read_users
    for name in _READS:
        setattr(jax.stages.Compiled, name, _reading(name))


def _users(compiled):
    """The user's compile of `compiled`, compiled on first read; None for a compile not redirected."""
    users = compiled.__dict__.get("_suite_users")
    return None if users is None else users()


def _reading(name):
    read = _original[name]

    def read_users(self):
        users = _users(self)
        return read(users if users is not None else self)

    read_users.__doc__ = read.__doc__
    return read_users


def fast_executable_text(compiled) -> str:
    """The HLO of the executable a test runs (the suite's fast compile), not the user's."""
    return _original["as_text"](compiled)

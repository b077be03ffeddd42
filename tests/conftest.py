"""Eight simulated CPU devices for every test, fixed before JAX starts its backends."""
import collections
import os
import re
import shutil
import tempfile

# Default sample stores made on first use go to a per-session directory, not the user's cache;
# the process that makes it (xdist's controller; its workers and the commands tests start inherit
# it) removes it when the run ends (`pytest_unconfigure`).
_MADE_CACHE = None if "XLAOPT_CACHE" in os.environ else tempfile.mkdtemp(prefix="xlaopt-test-cache-")
os.environ.setdefault("XLAOPT_CACHE", _MADE_CACHE or "")
# The suite compiles for speed and reads a user's compile wherever it reads one (suite_compile.py).
import suite_compile  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), suite_compile.LLVM_O0,
                                                 suite_compile.ELEMENTAL_EMITTERS,
                                                 "--xla_force_host_platform_device_count=8")))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# CPU only, also where a GPU plugin is installed (xlaopt[gpu-aot]): its compile-only topologies
# need the plugin registered without a driver, and the tests' meshes are simulated CPU devices.
jax.config.update("jax_platforms", "cpu")
jax.devices()  # start the backend now so no later call can change the device count
suite_compile.install()

from xlaopt.compiler import cache as compile_cache  # noqa: E402

# JAX's persistent cache in this run's directory (under XLAOPT_CACHE, so the commands the tests start
# in other processes share it): programs built apart, in-process or not, compile once.
compile_cache.configure(None)

from xlaopt.data.batch import BatchShape  # noqa: E402
from xlaopt.data.synthetic_cosmos import SyntheticCosmos  # noqa: E402
from xlaopt.models.registry import get_config  # noqa: E402
from xlaopt.runtime import distributed  # noqa: E402

# Small enough to compile in seconds; the layout and every size still divide 8. Two layers, not
# one, so the layer stack stays a loop whose per-layer collectives the HLO tests count.
SMALL = dict(num_layers=2)
# One tiny size per family, used by every test unless it needs another and says why: equal
# configs make equal programs, which compile once a run (`compile_program`, the persistent cache).
COSMOS3_TINY = get_config("cosmos3-tiny", SMALL)
LLAMA_TINY = get_config("llama-tiny", SMALL)


@pytest.fixture(scope="session")
def tiny_config():
    return COSMOS3_TINY


@pytest.fixture(scope="session")
def batch_shape():
    return BatchShape(batch_size=8, text_len=48, gen_len=96)


@pytest.fixture(scope="session")
def synthetic_batch(tiny_config, batch_shape):
    return SyntheticCosmos(tiny_config, batch_shape, seed=3).batch(0)


def needs_devices(n: int):
    return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices")


def command_env(devices: int | None = None, fast_compile: bool = True, cpu_only: bool = True,
                **extra: str) -> dict:
    """The environment of a process a test starts: CPU only (unless `cpu_only=False`: the process
    picks its platform as a user's does), the suite's fast compile (unless `fast_compile=False`:
    compiled as a user's is; see suite_compile.py), and `devices` simulated devices where given
    (else the process asks for its own, as the CLI does from its mesh)."""
    flags = (suite_compile.COMMAND_FLAGS if fast_compile else "") + (
        f" --xla_force_host_platform_device_count={devices}" if devices else "")
    env = dict(os.environ, XLA_FLAGS=flags, **extra)
    if cpu_only:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    return env


def free_port() -> int:
    """A free local TCP port, for a `jax.distributed` coordinator."""
    return distributed.free_port()


def finish(procs, timeout_s: float, expect: str = "") -> None:
    """Wait for worker processes; each must exit 0 (and print `expect`). On a failure the rest
    are killed: a failed peer leaves the others blocked in a collective or at a barrier."""
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            assert p.returncode == 0 and expect in out, \
                f"{' '.join(map(str, p.args[1:]))} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# One device's first-step (loss, gradients) per single-device reference program, computed once a run:
# the pass tests of several files compare against the same references.
_REFERENCE_GRADS: dict = {}


def reference_grads(program):
    """The first-step loss and gradients of `program`'s single-device reference (verify's)."""
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.runtime.verify import one_step_grads, reference_program

    single, _ = run_pipeline(reference_program(program), pipeline())
    if single not in _REFERENCE_GRADS:
        _REFERENCE_GRADS[single] = one_step_grads(single)
    return _REFERENCE_GRADS[single]


def loop_line(text: str, trips: int) -> str:
    """The instruction of the one loop of `trips` iterations in a compiled module (XLA's known trip count)."""
    (line,) = [line for line in text.splitlines() if " while(" in line and f'"known_trip_count":{{"n":"{trips}"}}' in line]
    return line


def loop_state(text: str, trips: int) -> collections.Counter:
    """(dtype, dims) of each array the one loop of `trips` iterations carries, with multiplicity."""
    return collections.Counter(re.findall(r"(\w+)\[([\d,]*)\]", loop_line(text, trips).split(" while(")[0]))


def check_pass(program, topology=None, options=None, *, reference: bool = True, dtype: str = "float32"):
    """The pass contract, for every pass test: the pipeline (`options` for its passes) on `program`
    for `topology`, whose checks make each `changed` honest; run again on its result it changes
    nothing and returns an equal program; and (unless `reference=False`) one sharded step's loss and
    gradients equal the single-device reference's. Returns (laid-out program, {name: record})."""
    from xlaopt.context import PassContext
    from xlaopt.pipeline import pipeline, run_pipeline
    from xlaopt.runtime.verify import compare, one_step_grads

    laid, records = run_pipeline(program, pipeline(options), ctx=PassContext.for_program(program, topology))
    again, second = run_pipeline(laid, pipeline(options), ctx=PassContext.for_program(laid, topology))
    assert [r.name for r in second if r.changed] == [], [(r.name, r.report) for r in second if r.changed]
    assert again == laid
    if reference:
        result = compare(one_step_grads(laid), reference_grads(program), dtype)
        assert result["ok"], result
    return laid, {r.name: r for r in records}


# The test files that take longest, longest first, as measured in a two-worker run (docs/tests.md).
# `--dist loadfile` hands each worker the next file when it finishes one; a long file handed out
# last runs alone on one core while the other idles, so the long ones go first. (Ordered by the
# `--durations=0` run of 2026-12-06 01:29, each file's tests summed.)
LONGEST_FILES = (
    "test_pipeline_parallel.py", "test_faults.py", "test_stack.py", "test_verify.py", "test_hlo.py", "test_cli.py",
    "test_trainable.py", "test_layout.py", "test_resnet.py", "test_plan.py", "test_checkpoint_train.py",
    "test_attention.py", "test_attention_work.py", "test_remat.py", "test_analyze.py", "test_pipeline.py",
    "test_train_process.py", "test_sequence_parallel.py", "test_hierarchical_grads.py", "test_api.py",
    "test_ulysses.py", "test_collective_matmul.py", "test_compile_cache.py", "test_checkpoint_process.py",
    "test_generate_sharded.py", "test_sample_cosmos.py", "test_loader.py", "test_vit.py", "test_loss_scale.py",
    "test_interop.py", "test_calibrate.py", "test_pipeline_1f1b.py", "test_fp8.py", "test_local_tier.py",
)


def pytest_unconfigure(config):
    if _MADE_CACHE is not None:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep this order, not most-tests-first
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order

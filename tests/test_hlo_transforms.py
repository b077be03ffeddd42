"""HLO transforms reach XLA's module before and after its scheduler, survive JAX's caches
without going stale, and are refused where jax 0.10.2 would silently skip them."""
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from xlaopt.analysis import gpu_aot
from xlaopt.compile import compile_program
from xlaopt.errors import UserError
from xlaopt.mesh import MESH_AXES, MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram
from xlaopt.transforms import hlo_proto
from xlaopt.transforms.rename import RenameInstructions


def test_wire_codec_round_trips_a_real_module_byte_for_byte():
    proto = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(4)).compiler_ir("hlo").as_serialized_hlo_module_proto()
    assert hlo_proto.serialize(hlo_proto.parse(proto)) == proto
    assert hlo_proto.map_instructions(proto, lambda fields: None) is None
    renamed = RenameInstructions(opcodes=("sine",), prefix="tagged_").rewrite(proto)
    assert renamed is not None and len(renamed) == len(proto) + len("tagged_")
    assert RenameInstructions(opcodes=("sine",), prefix="tagged_").rewrite(renamed) is None  # idempotent


# Runs in its own process: JAX decides once per process whether the persistent cache is used.
_CACHED_COMPILES = textwrap.dedent("""
    import sys, jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from xlaopt.compiler import cache as compile_cache
    from xlaopt.compile import compile_program
    from xlaopt.models.registry import get_config
    from xlaopt.program import TrainProgram
    from xlaopt.transforms.rename import RenameInstructions

    compile_cache.configure(sys.argv[1])  # as every command does
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every compile written, however small
    plain = TrainProgram(get_config("llama-tiny", {"num_layers": 1}))
    text = lambda p: compile_program(p).grads.as_text()
    pre = RenameInstructions(opcodes=("parameter",), prefix="pre_sched_")
    post = RenameInstructions(opcodes=("parameter",), prefix="post_sched_", stage="post-scheduler")
    runs = [("plain", plain), ("pre", plain.replace(hlo_transforms=(pre,))),
            ("post", plain.replace(hlo_transforms=(post,))), ("plain again", plain),
            ("pre again", plain.replace(hlo_transforms=(pre,)))]
    for label, program in runs:
        t = text(program)
        print(label, "pre_sched_" in t, "post_sched_" in t, "is_scheduled=true" in t.splitlines()[0])
""")


@pytest.mark.slow
def test_renames_show_in_the_compiled_text_with_the_persistent_cache_on(tmp_path):
    """The plain program is compiled (and cached) first: a transformed program compiled after it
    must not get the cached executable, nor the plain one the transformed executable."""
    # The second process finds every executable on disk (a restart): each must still be its own,
    # and it adds no entry (each compile was a hit on its own key).
    entries = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CACHED_COMPILES, str(tmp_path / "cache")], capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.splitlines() == ["plain False False True", "pre True False True", "post False True True",
                                           "plain again False False True", "pre again True False True"]
        entries.append(sorted(p.name for p in (tmp_path / "cache").glob("*-cache")))
        assert entries[-1], "the persistent cache was not used"
    assert entries[1] == entries[0]


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="stage 'after'; use one of pre-scheduler, post-scheduler"):
        RenameInstructions(opcodes=("dot",), prefix="x", stage="after")


@pytest.mark.skipif(not gpu_aot.available(), reason="needs the gpu-aot extra (jax-cuda12-plugin)")
def test_deviceless_gpu_compile_skips_registered_transforms_so_programs_refuse_them():
    """On jax 0.10.2 a transform registered for CUDA is attached when a CUDA backend starts; a
    compile-only topology starts none, so XLA's GPU pipeline compiles without it. If this first
    assertion ever fails, JAX runs them and the refusal in xlaopt.compile can go."""
    from jax.extend import xla as jex_xla
    from jax.sharding import NamedSharding, PartitionSpec

    from xlaopt.analysis.topology import parse_topology

    topology = parse_topology("h100:1x2")
    mesh = gpu_aot.gpu_mesh(topology, (2,), ("data",))
    calls = []
    jex_xla.register_hlo_module_transformation(lambda proto: calls.append(1), name="xlaopt-test-probe",
                                               platforms=["cuda", "gpu"])
    try:
        sharding = NamedSharding(mesh, PartitionSpec("data"))
        arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
        text = jax.jit(lambda x: jnp.sin(x) * 2).lower(arg).compile().as_text()
    finally:
        jex_xla.clear_hlo_module_transformation("xlaopt-test-probe")
    assert text.startswith("HloModule") and calls == []

    program = TrainProgram(get_config("llama-tiny", {"num_layers": 1}), MeshSpec.parse("data=2"), target="gpu")
    program, _ = run_pipeline(program.replace(hlo_transforms=(RenameInstructions(opcodes=("dot",), prefix="x_"),)),
                              pipeline())
    devices = gpu_aot.gpu_mesh(topology, program.mesh.sizes, MESH_AXES)
    with pytest.raises(UserError, match="cannot run in a deviceless GPU compile on jax 0.10.2"):
        compile_program(program, devices).train_step  # noqa: B018


def test_fingerprint_follows_parameters_and_code_even_without_a_source_file():
    assert RenameInstructions(opcodes=("dot",), prefix="a_").fingerprint() == \
        RenameInstructions(opcodes=("dot",), prefix="a_").fingerprint()
    assert RenameInstructions(opcodes=("dot",), prefix="a_").fingerprint() != \
        RenameInstructions(opcodes=("dot",), prefix="b_").fingerprint()
    made = []
    for body in ("return None", "return module_proto"):  # classes with no source file (as in python -c)
        namespace = {}
        exec("import dataclasses\nfrom xlaopt.transforms import HloTransform\n"
             "@dataclasses.dataclass(frozen=True, kw_only=True)\nclass Made(HloTransform):\n"
             f"    name = 'made'\n    def rewrite(self, module_proto):\n        {body}\n", namespace)
        made.append(namespace["Made"]().fingerprint())
    assert made[0] != made[1]

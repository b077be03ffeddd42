"""The pass pipeline's contract: honest `changed`, idempotence, disabling by name, dumps,
and room for traced-function and compiled-HLO passes."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from xlaopt.compile import compile_program
from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec
from xlaopt.pipeline import PassResult, PipelineError, pipeline, run_pipeline, select_passes
from xlaopt.program import HloTransform, NamedTransform, TrainProgram

from conftest import needs_devices


@pytest.fixture(scope="module")
def program(tiny_config):
    return TrainProgram(tiny_config, MeshSpec.parse("fsdp=2,tensor=2"))


def test_passes_have_kebab_names_and_summaries():
    names = [p.name for p in pipeline()]
    assert names[0] == "mesh-layout" and len(set(names)) == len(names)
    assert all(p.summary and "\n" not in p.summary for p in pipeline())


def test_mesh_layout_changes_once_then_nothing(program):
    once, records = run_pipeline(program, pipeline())
    assert records[0].changed and once.shardings is not None and program.shardings is None  # input untouched
    twice, records2 = run_pipeline(once, pipeline())
    assert not records2[0].changed and twice == once


def test_changed_must_be_honest(program):
    @dataclasses.dataclass(frozen=True)
    class Liar:
        name: str = "liar"
        summary: str = "claims a change it did not make"

        def run(self, p):
            return PassResult(p, True, {})

    with pytest.raises(PipelineError, match="'liar' reported changed=True but the program did not change"):
        run_pipeline(program, (pipeline()[0], Liar()))


def test_failing_pass_is_named_with_what_ran_before(program):
    @dataclasses.dataclass(frozen=True)
    class Broken:
        name: str = "broken"
        summary: str = "raises"

        def run(self, p):
            raise KeyError("boom")

    with pytest.raises(PipelineError, match="'broken' failed \\(passes run before it: mesh-layout\\)"):
        run_pipeline(program, (pipeline()[0], Broken()))


def test_disable_by_name_leaves_everything_replicated(program):
    passes = select_passes(pipeline(), disable=["mesh-layout"])
    assert passes == ()
    out, records = run_pipeline(program, passes)
    assert out == program and records == []
    compiled = compile_program(out)
    assert all(s.spec == P() for s in jax.tree.leaves(compiled.state_shardings))
    with pytest.raises(UserError, match="unknown pass 'mesh-layuot'"):
        select_passes(pipeline(), disable=["mesh-layuot"])


@needs_devices(4)
def test_dump_appears_where_asked(program, tmp_path):
    small = program.replace(settings=dataclasses.replace(program.settings, compute_dtype="float32"))
    _, records = run_pipeline(small, pipeline(), dump_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.compiled.hlo", "00-input.lowered.mlir",
                     "01-mesh-layout.compiled.hlo", "01-mesh-layout.lowered.mlir"]
    assert records[0].dumped == (str(tmp_path / "01-mesh-layout.lowered.mlir"), str(tmp_path / "01-mesh-layout.compiled.hlo"))
    before = (tmp_path / "00-input.compiled.hlo").read_text()
    after = (tmp_path / "01-mesh-layout.compiled.hlo").read_text()
    assert before.startswith("HloModule") and after.startswith("HloModule")
    # Replicated params need no gathers; FSDP-sharded params are all-gathered before use.
    assert before.count("all-gather") == 0 and after.count("all-gather") > 0


def test_traced_function_and_hlo_levels_are_wired(program):
    """A grad transform rewrites the traced step; an HLO transform sees the compiled module."""
    seen = []

    def watch(module_proto: bytes):
        seen.append(len(module_proto))
        return None  # unchanged

    def double_loss(grad_fn):
        def wrapped(params, batch, key):
            loss, metrics, grads = grad_fn(params, batch, key)
            return 2 * loss, metrics, grads
        return wrapped

    base = TrainProgram(program.model)  # single device
    rewritten = base.replace(grad_transforms=(NamedTransform("double-loss", double_loss),),
                             hlo_transforms=(HloTransform("watch", watch),))
    from xlaopt.data.synthetic_cosmos import SyntheticCosmos
    batch = SyntheticCosmos(base.model, base.settings.batch).batch(0)
    losses = []
    for p in (base, rewritten):
        c = compile_program(p)
        params = c.init(jax.random.key(0)).params
        losses.append(float(c.grads(params, c.put_batch(batch), jax.random.key(1))[0]))
    assert seen, "the HLO transformation was never called"
    np.testing.assert_allclose(losses[1], 2 * losses[0], rtol=1e-6)

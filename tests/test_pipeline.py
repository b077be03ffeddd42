"""The pass pipeline's contract: honest `changed`, idempotence, disabling by name, dumps,
and room for traced-function and compiled-HLO passes."""
import collections
import dataclasses
import inspect
from typing import ClassVar

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from xlaopt.analysis.topology import parse_topology
from xlaopt.compile import compile_program
from xlaopt.context import Pass, PassContext, PassResult
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.pipeline import PipelineError, parse_pass_options, pass_classes, pipeline, run_pipeline, select_passes
from xlaopt.program import TrainProgram
from xlaopt.transforms import GradTransform, HloTransform
from xlaopt.transforms.compiler_options import CompilerOptions

from conftest import LLAMA_TINY, needs_devices


@pytest.fixture(scope="module")
def program(tiny_config):
    return TrainProgram(tiny_config, MeshSpec.parse("fsdp=2,tensor=2"))


def test_passes_have_kebab_names_and_summaries():
    names = [p.name for p in pipeline()]
    assert names[:2] == ["layout-plan", "mesh-layout"] and len(set(names)) == len(names)
    assert all(p.summary and "\n" not in p.summary for p in pipeline())


def test_a_pass_and_its_transform_are_named_alike():
    """The pass `x-y` in passes/x_y.py installs XYTransform from xlaopt/transforms/x_y.py, named `x-y`."""
    import importlib

    for cls in pass_classes():
        module = cls.name.replace("-", "_")
        assert cls.__module__ == f"xlaopt.passes.{module}" and cls.__name__ == cls.name.title().replace("-", "")
        try:
            transforms = importlib.import_module(f"xlaopt.transforms.{module}")
        except ModuleNotFoundError:
            continue  # a pass that installs no transform (it lays out, plans or sets options)
        (transform,) = [v for v in vars(transforms).values() if isinstance(v, type) and v.__module__ == transforms.__name__
                        and issubclass(v, GradTransform)]
        assert transform.__name__ == f"{cls.__name__}Transform" and transform.name == cls.name


def test_mesh_layout_changes_once_then_nothing(program):
    once, records = run_pipeline(program, pipeline())
    by_name = {r.name: r for r in records}
    assert not by_name["layout-plan"].changed and "off unless enabled" in by_name["layout-plan"].report["skipped"]
    assert by_name["mesh-layout"].changed and once.shardings is not None and program.shardings is None  # input untouched
    twice, records2 = run_pipeline(once, pipeline())
    assert [r.changed for r in records2] == [False] * len(pipeline()) and twice == once


def test_equal_programs_built_apart_hash_and_compare_equal(program):
    ctx = PassContext()
    a, _ = run_pipeline(program, pipeline(), ctx=ctx)
    rebuilt = TrainProgram(get_config("cosmos3-tiny", {"num_layers": 2}), MeshSpec.parse("tensor=2,fsdp=2"),
                           compiler_options={"xla_cpu_enable_fast_math": False})
    b, _ = run_pipeline(rebuilt, pipeline())
    a = a.replace(compiler_options=CompilerOptions([("xla_cpu_enable_fast_math", False)]))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.shardings.state.params["embed_ED"] == P("tensor", "fsdp")  # the flat form unflattens
    assert b != b.replace(execution=ExecutionConfig(remat="full"))
    # The context's cache traced the model once for the first run, not once per lookup.
    run_pipeline(program, pipeline(), ctx=ctx)
    assert ctx.cache.misses == 3


def test_layout_plan_when_enabled_replaces_the_mesh_with_its_best_candidate(program):
    from xlaopt.analysis.topology import preset
    from xlaopt.errors import UserError

    passes = pipeline({"layout-plan": {"enabled": True, "top": 0}})  # analytic prices only: nothing compiled
    with pytest.raises(UserError, match="layout-plan needs a topology"):
        run_pipeline(program, passes)
    planned, records = run_pipeline(program, passes, ctx=PassContext(topology=preset("h100", 1, 8)))
    report = records[0].report
    assert records[0].changed and report["method"] == "analytic" and planned.mesh.num_devices == 8
    best = report["best"]["layout"]
    assert {a: s for a, s in planned.mesh.as_dict().items() if s > 1} == best["mesh"]
    assert planned.execution.remat == best.get("execution", {}).get("remat", "none")
    assert planned.shardings is not None  # mesh-layout applied the new mesh after it


def test_a_pass_reads_the_topology_and_target_from_its_context(program):
    @dataclasses.dataclass(frozen=True)
    class NodeSized(Pass):
        name: ClassVar[str] = "node-sized"
        summary: ClassVar[str] = "sets the number of micro-batches from the GPUs per node (a toy rule)"

        def run(self, p, ctx):
            assert ctx.target == "gpu"
            execution = dataclasses.replace(p.execution, micro_batches=ctx.topology.devices_per_node)
            new = p.replace(execution=execution)
            return PassResult(new, new != p, {"devices_per_node": ctx.topology.devices_per_node})

    gpu = program.replace(target="gpu")
    ctx = PassContext.for_program(gpu, parse_topology("h100:2x4"))
    out, records = run_pipeline(gpu, (NodeSized(),), ctx=ctx)
    assert out.execution.micro_batches == 4 and records[0].report == {"devices_per_node": 4}
    with pytest.raises(UserError, match="the pipeline runs for target cpu but the program is built for gpu"):
        run_pipeline(gpu, (NodeSized(),), ctx=PassContext())


def test_pass_options_are_typed_and_checked():
    options = parse_pass_options(["mesh-layout.constrain_activations=false"])
    layout = lambda passes: next(p for p in passes if p.name == "mesh-layout")
    assert layout(pipeline(options)).constrain_activations is False and layout(pipeline()).constrain_activations is True
    assert parse_pass_options(["layout-plan.top=3"]) == {"layout-plan": {"top": 3}}
    for item, message in [("mesh-layuot.x=1", "unknown pass 'mesh-layuot'; passes are: layout-plan, mesh-layout"),
                          ("mesh-layout.constrain=1", "did you mean 'constrain_activations'"),
                          ("mesh-layout.constrain_activations=maybe", "not a valid bool"),
                          ("constrain_activations=false", "expected PASS.FIELD=VALUE")]:
        with pytest.raises(UserError, match=message):
            parse_pass_options([item])


def test_compiler_options_are_sorted_and_conflicts_refused():
    a = CompilerOptions.parse(["xla_cpu_enable_fast_math=false", "xla_backend_optimization_level=2"])
    b = CompilerOptions({"xla_backend_optimization_level": 2, "xla_cpu_enable_fast_math": False})
    assert a == b and hash(a) == hash(b) and list(a) == ["xla_backend_optimization_level", "xla_cpu_enable_fast_math"]
    assert CompilerOptions([("xla_dump_to", "x"), ("xla_dump_to", "x")]) == {"xla_dump_to": "x"}
    with pytest.raises(UserError, match="given twice, as 1 and 2; keep one"):
        CompilerOptions([("xla_backend_optimization_level", 1), ("xla_backend_optimization_level", 2)])
    with pytest.raises(UserError, match="xla_gpu_enable_latency_hiding_scheduler is for XLA's GPU compiler; "
                                        "this program compiles for cpu"):
        TrainProgram(get_config("llama-tiny"), compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True})
    TrainProgram(get_config("llama-tiny"), target="gpu", compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True})


def test_an_unknown_compiler_option_is_named_by_xla():
    program = TrainProgram(get_config("llama-tiny", {"num_layers": 1}), compiler_options={"xla_no_such_flag": 1})
    with pytest.raises(UserError, match="No such compile option: 'xla_no_such_flag'"):
        compile_program(program).grads  # noqa: B018


def test_changed_must_be_honest(program):
    @dataclasses.dataclass(frozen=True)
    class Liar(Pass):
        name: ClassVar[str] = "liar"
        summary: ClassVar[str] = "claims a change it did not make"

        def run(self, p, ctx):
            return PassResult(p, True, {})

    with pytest.raises(PipelineError, match="'liar' reported changed=True but the program did not change"):
        run_pipeline(program, (pipeline()[0], Liar()))


def test_failing_pass_is_named_with_what_ran_before(program):
    @dataclasses.dataclass(frozen=True)
    class Broken(Pass):
        name: ClassVar[str] = "broken"
        summary: ClassVar[str] = "raises"

        def run(self, p, ctx):
            raise KeyError("boom")

    with pytest.raises(PipelineError, match="'broken' failed \\(passes run before it: mesh-layout\\)"):
        run_pipeline(program, (*select_passes(pipeline(), only=["mesh-layout"]), Broken()))


def test_disable_by_name_leaves_everything_replicated(program):
    passes = select_passes(pipeline(), disable=["mesh-layout"])
    # layout-plan and collective-matmul are off unless enabled, hierarchical-grads and
    # ulysses-attention need a layout, overlap-flags does not fit the cpu target: nothing changes.
    assert [p.name for p in passes] == ["layout-plan", "hierarchical-grads", "collective-matmul",
                                        "ulysses-attention", "overlap-flags"]
    out, records = run_pipeline(program, passes)
    assert out == program and [r.changed for r in records] == [False] * 5
    compiled = compile_program(out)
    assert all(s.spec == P() for s in jax.tree.leaves(compiled.state_shardings))
    with pytest.raises(UserError, match="unknown pass 'mesh-layuot'"):
        select_passes(pipeline(), disable=["mesh-layuot"])


@needs_devices(4)
def test_dump_appears_where_asked(tmp_path):
    small = TrainProgram(LLAMA_TINY, MeshSpec.parse("fsdp=2,tensor=2"), execution=ExecutionConfig(compute_dtype="float32"))
    _, records = run_pipeline(small, pipeline(), dump_dir=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.compiled.hlo", "00-input.diff", "00-input.lowered.mlir", "02-mesh-layout.compiled.hlo",
                     "02-mesh-layout.diff", "02-mesh-layout.lowered.mlir"]  # layout-plan: off, no change
    assert records[0].dumped == ()
    assert records[1].dumped == tuple(str(tmp_path / f"02-mesh-layout.{kind}") for kind in ("diff", "lowered.mlir",
                                                                                             "compiled.hlo"))
    # Beside the HLO, what the pass changed in the program: the layout, from none.
    diff = (tmp_path / "02-mesh-layout.diff").read_text().splitlines()
    assert len(diff) == 1 and diff[0].startswith("shardings: none -> ") and "sharded" in diff[0], diff
    before = (tmp_path / "00-input.compiled.hlo").read_text()
    after = (tmp_path / "02-mesh-layout.compiled.hlo").read_text()
    assert before.startswith("HloModule") and after.startswith("HloModule")
    # Replicated params need no gathers; FSDP-sharded params are all-gathered before use.
    assert before.count("all-gather") == 0 and after.count("all-gather") > 0


@dataclasses.dataclass(frozen=True)
class ScaleLoss(GradTransform):
    name = "scale-loss"
    factor: float

    def apply(self, grad_fn):
        def wrapped(params, batch, key):
            loss, metrics, grads = grad_fn(params, batch, key)
            return self.factor * loss, metrics, grads
        return wrapped


@dataclasses.dataclass(frozen=True, kw_only=True)
class Watch(HloTransform):
    name = "watch"
    seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def rewrite(self, module_proto):
        self.seen.append(len(module_proto))
        return None  # unchanged


def test_transforms_compare_by_value():
    assert ScaleLoss(2.0) == ScaleLoss(2.0) and hash(ScaleLoss(2.0)) == hash(ScaleLoss(2.0))
    assert ScaleLoss(2.0) != ScaleLoss(3.0)
    with pytest.raises(TypeError, match="is not a GradTransform"):
        TrainProgram(get_config("llama-tiny"), grad_transforms=(lambda f: f,))


def test_traced_function_and_hlo_levels_are_wired(program):
    """A grad transform rewrites the traced step; an HLO transform sees the compiled module."""
    from xlaopt.data.synthetic_text import SyntheticText

    watch = Watch()
    base = TrainProgram(LLAMA_TINY)  # single device; any model's step is wired the same way
    rewritten = base.replace(grad_transforms=(ScaleLoss(2.0),), hlo_transforms=(watch,))
    batch = SyntheticText(base.model, base.settings.batch).batch(0)
    losses = []
    for p in (base, rewritten):
        c = compile_program(p)
        params = c.init(jax.random.key(0)).params
        losses.append(float(c.grads(params, c.put_batch(batch), jax.random.key(1))[0]))
    assert watch.seen, "the HLO transformation was never called"
    np.testing.assert_allclose(losses[1], 2 * losses[0], rtol=1e-6)


def _own_backward_rule() -> str:
    """The name of the model's own backward rule making the current call, or ''."""
    rules = ("_embedding_lookup_bwd", "_gathered_gradient_bwd", "_gathered_bwd")
    return next((f.function for f in inspect.stack(0) if f.function in rules), "")


@needs_devices(4)
def test_tracing_installs_the_mesh_and_constraints_compose(program):
    """A rewrite sees the program's mesh while tracing, and a constraint it installs runs
    together with the layout's own on every activation."""
    from xlaopt.models.layers import activation_constraint

    seen = []

    class Record(GradTransform):
        name = "record"

        def apply(self, grad_fn):
            def wrapped(params, batch, key):
                seen.append(dict(jax.sharding.get_abstract_mesh().shape))
                with activation_constraint(lambda x, axes: seen.append((axes, _own_backward_rule())) or x):
                    return grad_fn(params, batch, key)
            return wrapped

    laid_out, _ = run_pipeline(program.replace(grad_transforms=(Record(),)), pipeline())
    # Traced twice (the layout pass's abstract trace, then the compile), each time on the mesh.
    lowered = compile_program(laid_out).lowered.as_text()
    marks = [i for i, s in enumerate(seen) if isinstance(s, dict)]
    assert [seen[i] for i in marks] == [{"stage": 1, "data": 1, "fsdp": 2, "tensor": 2, "context": 1}] * 2
    recorded = len(seen) - marks[1] - 1
    # Every activation the recorder saw also got the layout's sharding constraint, and no other:
    # each once in the forward pass and at most once more, transposed, in the backward pass.
    # Backward rules of the model's own (`models/layers.py`) constrain once, seen by the recorder
    # as calls of their own: an embedding lookup's (twice: the rows' move to the table's split,
    # then the table's sharding; for the token and the modality tables), each sub-block output's
    # gradient gathered (`gathered_gradient`) and each gathered norm output's gradient put back
    # on the residual stream's shards (`gathered`: constrained twice in a row forward, onto the
    # shards then whole, and not transposed; JAX may trace a custom_vjp's function beside its
    # forward rule, so the recorder can see those twice).
    traced = seen[marks[1] + 1:]
    own = collections.Counter(rule for _, rule in traced if rule)
    assert own["_embedding_lookup_bwd"] == 4 and own["_gathered_gradient_bwd"] >= 4 and own["_gathered_bwd"] >= 4
    forward = recorded - sum(own.values())
    constraints = lowered.count("sdy.sharding_constraint")
    assert forward > 10 and forward + sum(own.values()) <= constraints <= 2 * forward + sum(own.values())

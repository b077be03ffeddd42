"""xlaopt from Python: the handful of calls an experiment script or a notebook needs.

    import xlaopt

    xlaopt.simulated_devices(8)                  # before anything starts JAX
    program = xlaopt.build_program("cosmos3-tiny", "fsdp=4,tensor=2", overrides={"num_layers": 2},
                                   execution={"remat": "full"})
    program, records = xlaopt.optimize(program)  # the pass pipeline
    xlaopt.verify(program)["ok"]                 # sharded vs one device
    xlaopt.analyze(program, "h100:1x8")          # priced on a cluster
    xlaopt.train(program, steps=5)               # a few real steps
    xlaopt.show(program, "h100:1x8")             # the notebook view

`import xlaopt` imports no JAX: every call here imports what it needs when it runs, so the
simulated device count can still be set first.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence


def simulated_devices(count: int) -> list:
    """Start JAX on `count` simulated CPU devices and return them; must run before anything
    else starts JAX's backends (the device count is fixed from then on)."""
    import jax

    from xlaopt.mesh import request_cpu_devices

    jax.config.update("jax_platforms", "cpu")
    request_cpu_devices(count)
    return jax.devices()


def build_program(model: str | Any, mesh: Any = "", *, layout: str | None = None,
                  overrides: Mapping[str, Any] | None = None, batch: Any = None,
                  execution: Mapping[str, Any] | Any = None, target: str = "cpu",
                  compiler_options: Mapping[str, Any] | None = None, seed: int = 0,
                  sequence_parallel: bool = False):
    """A TrainProgram of a registered model (a name, with `overrides` of its config fields, or a
    config), on a mesh ("fsdp=4,tensor=2" or a MeshSpec) or a layout file (mesh, order, rules, and
    the batch and execution it holds, which `batch` and `execution` given here replace).
    `batch`: a BatchShape or (rows, text tokens, generator tokens); default the family's.
    `execution`: an ExecutionConfig or its fields as a mapping. `sequence_parallel`: the residual
    stream split over the tensor ranks too (`xlaopt.sharding.with_sequence_parallel`)."""
    import dataclasses

    from xlaopt.build import build_program as build, choose_layout
    from xlaopt.data.batch import BatchShape
    from xlaopt.execution import ExecutionConfig
    from xlaopt.models.registry import get_config

    config = get_config(model, dict(overrides or {})) if isinstance(model, str) else model
    chosen = choose_layout(mesh, layout, config.name, sequence_parallel)
    batch = chosen.batch if batch is None else batch
    execution = chosen.execution if execution is None else execution
    if batch is not None and not isinstance(batch, BatchShape):
        batch = BatchShape(*batch)
    if execution is not None and not isinstance(execution, ExecutionConfig):
        execution = dataclasses.replace(ExecutionConfig(), **dict(execution))
    return build(config, chosen, batch, execution, seed=seed, target=target, compiler_options=dict(compiler_options or {}))


def optimize(program, *, topology: Any = None, passes: Sequence[str] | None = None, disable: Sequence[str] = (),
             options: Mapping[str, Mapping[str, Any]] | None = None, dump_dir: str | None = None):
    """Run the pass pipeline (or the passes named in `passes`, minus `disable`, each built with
    `options[name]`); returns (the new program, a record per pass)."""
    from xlaopt.context import PassContext
    from xlaopt.pipeline import pipeline, run_pipeline, select_passes

    chosen = select_passes(pipeline(options), passes, disable)
    return run_pipeline(program, chosen, dump_dir, PassContext.for_program(program, _topology(topology)))


def compile_program(program):
    """The program's jitted, sharded functions (`.train_step`, `.grads`, `.init`, `.lowered`)."""
    from xlaopt.compile import compile_program as compile_

    return compile_(program)


def verify(program) -> dict:
    """One gradient step of `program` against the same program on one device (run through the
    same pipeline; in float32 when `program` computes in float16); `["ok"]` says whether they
    agree within the compute dtype's tolerance."""
    from xlaopt.runtime.verify import compare, one_step_grads, reference_program, tolerance_key

    single, _ = optimize(reference_program(program))
    return compare(one_step_grads(program), one_step_grads(single), tolerance_key(program.execution))


def analyze(program, topology: Any) -> dict:
    """Compile `program` for its target and price the step on `topology` (a preset such as
    "h100:16x8", a file, or a Topology): step time, MFU, exposed communication, memory."""
    from xlaopt.analysis.analyze import analyze as analyze_

    return analyze_(program, _topology(topology))


def train(program, steps: int, *, data: str | None = None, ckpt: Any = None, progress: bool = False) -> dict:
    """Train `steps` steps (on a sample store `data`, else the family's synthetic stream); the
    run's summary. `ckpt`: an `xlaopt.runtime.saving.CheckpointOptions`."""
    from xlaopt.runtime.train import train as train_

    return train_(program, steps, progress=progress, data_dir=data, ckpt=ckpt)


def show(program, topology: Any = "h100:1x8"):
    """The notebook view of the analysed step: tables and a timeline, rendered as HTML."""
    from xlaopt.analysis.notebook import show as show_

    return show_(program, _topology(topology))


def parse_topology(spec: Any):
    """A cluster topology from a preset ("h100:16x8"), a TOML/JSON file, or a Topology."""
    return _topology(spec)


def _topology(spec: Any):
    if spec is None or not isinstance(spec, str):
        return spec
    from xlaopt.analysis.topology import parse_topology as parse

    return parse(spec)

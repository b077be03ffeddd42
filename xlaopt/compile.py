"""Turn a TrainProgram into jitted, sharded functions on a device mesh.

Tracing runs with the mesh installed (`jax.set_mesh`, so a shard_map rewrite finds it) and the
layout's activation constraints. Compilation passes the program's compiler options and
registers its HLO transforms for exactly that compile. Two facts of jax 0.10.2 shape this
(both shown by tests/test_hlo_transforms.py):
  - neither JAX's in-process executable cache nor its persistent cache keys on registered
    transforms, so a program with transforms also carries their fingerprint in its compile
    options: as a pass name in `xla_disable_hlo_passes` that no XLA pass has, which disables
    nothing and makes every cache key differ from one compiled without them;
  - transforms are registered for a non-CPU platform only when its backend initialises,
    which a compile-only (deviceless) GPU topology never does: XLA's GPU pipeline would
    silently compile without them, so such a program is refused.
"""
from __future__ import annotations

import collections
import contextlib
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xlaopt import loss_scale
from xlaopt.compiler import cache as compile_cache, log as compiler_log
from xlaopt.errors import UserError
from xlaopt.families import family_of
from xlaopt.mesh import make_mesh
from xlaopt.models.cudnn_attention import check_rows
from xlaopt.models.layers import activation_constraint, heads_split_over, manual_axes, rows_split_over
from xlaopt.program import TrainProgram
from xlaopt.sharding import batch_axes, head_axes, logical_to_spec
from xlaopt.step import abstract_state, batch_spec, build_init, build_train_step, first_step_grad_fn, trained_part
from xlaopt.transforms.ulysses_attention import UlyssesAttentionTransform

# Checkpoint leaf names of `TrainState.loss_scale` (see xlaopt.checkpoint.tree.named_leaves).
_SCALE_PREFIX = "loss_scale/"
_OPT_PREFIX = "opt_state/"
# Named in a transformed program's `xla_disable_hlo_passes` (no pass is called so): the compile
# options, and so the persistent cache's key, differ from the untransformed program's.
HLO_TRANSFORM_MARKER = "xlaopt-hlo-transform-"


class CompiledProgram:
    """A program's jitted functions on a mesh, each lowered and compiled on first use
    (with the program's activation constraints, compiler options and HLO transforms)."""

    def __init__(self, program: TrainProgram, mesh: jax.sharding.Mesh | None = None):
        self.program = program
        self.mesh = mesh = mesh or make_mesh(program.mesh)
        named = lambda spec: NamedSharding(mesh, spec)
        abstract = abstract_state(program)
        self._batch_spec = spec = batch_spec(program)
        if program.shardings is None:  # no layout applied: everything replicated
            state_specs = jax.tree.map(lambda _: PartitionSpec(), abstract)
            batch_specs = {k: PartitionSpec() for k in spec}
        else:
            state_specs, batch_specs = program.shardings.state, program.shardings.batch
        self.state_shardings = jax.tree.map(named, state_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.batch_shardings = {k: named(v) for k, v in batch_specs.items()}
        key_sh = named(PartitionSpec())
        # The state's shapes, dtypes and shardings: what a checkpoint restores onto.
        self.abstract_state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                            abstract, self.state_shardings)
        self._abstract_batch = {k: jax.ShapeDtypeStruct(s, d, sharding=self.batch_shardings[k])
                                for k, (s, d, _) in spec.items()}
        self._abstract_key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=key_sh)
        self._train_jit = jax.jit(build_train_step(program), donate_argnums=0,
                                  in_shardings=(self.state_shardings, self.batch_shardings, key_sh),
                                  out_shardings=(self.state_shardings, None))
        self._grads_jit = jax.jit(first_step_grad_fn(program),
                                  in_shardings=(self.state_shardings.params, self.batch_shardings, key_sh),
                                  out_shardings=(None, None, trained_part(program, self.state_shardings.params)))
        self._init_jit = jax.jit(build_init(program), out_shardings=self.state_shardings)
        # What XLA logged while compiling this program's functions, as one line a kind of trouble
        # (`xlaopt.compiler.log`): a command reports them beside its answer.
        self.compiler_notes: list[str] = []

    def put_batch(self, batch: dict):
        """Host batch -> global arrays. In a multi-process job `batch` holds this process's
        `local_rows` of the global batch (see `local_part`). Rows the program's attention cannot
        take are refused here, before the step runs (`cudnn_attention.check_rows`)."""
        check_batch_rows(self.program, batch)
        if jax.process_count() == 1:
            return jax.device_put(batch, self.batch_shardings)
        return {k: jax.make_array_from_process_local_data(self.batch_shardings[k], v, self._abstract_batch[k].shape)
                for k, v in batch.items()}

    def local_part(self, batch: dict) -> dict:
        """This process's rows of a whole host batch."""
        if jax.process_count() == 1:
            return batch
        rows = self.local_rows
        return {k: np.take(v, rows, axis=self._batch_spec[k][2].index("batch")) for k, v in batch.items()}

    @functools.cached_property
    def local_rows(self) -> range:
        """The rows of a global batch this process's devices hold: a loader need read only these."""
        name, (shape, _, axes) = next(iter(self._batch_spec.items()))
        axis, rows = axes.index("batch"), shape[axes.index("batch")]
        held = set()
        for index in self.batch_shardings[name].addressable_devices_indices_map(shape).values():
            held.update(range(*index[axis].indices(rows)))
        if held != set(range(min(held), max(held) + 1)):
            raise ValueError(f"this process holds batch rows {sorted(held)}, not one contiguous block; order the "
                             f"mesh's devices by process")
        return range(min(held), max(held) + 1)

    @functools.cached_property
    def lowered(self):
        """The train step lowered to StableHLO."""
        with _tracing_context(self.program, self.mesh):
            return self._train_jit.lower(self.abstract_state, self._abstract_batch, self._abstract_key)

    @functools.cached_property
    def train_step(self):
        """Compiled (state, batch, key) -> (state, metrics); the input state is donated.
        `.as_text()` on it is the scheduled, optimised HLO."""
        return self._compile(self.lowered)

    @functools.cached_property
    def grads(self):
        """Compiled (params, batch, key) -> (loss, metrics, grads), as the first train step
        computes them (under float16, with the loss scaled by `loss_scale_init`)."""
        with _tracing_context(self.program, self.mesh):
            lowered = self._grads_jit.lower(self.abstract_state.params, self._abstract_batch, self._abstract_key)
        return self._compile(lowered)

    @functools.cached_property
    def init(self):
        """Compiled key -> TrainState, created directly in its shardings."""
        return self._compile(self._init_jit.lower(self._abstract_key))

    def restore_state(self, manager, step: int):
        """(state, meta) of checkpoint `step` of `manager` (an `xlaopt.checkpoint.CheckpointManager`),
        laid out on this program's shardings. A checkpoint saved under another compute dtype
        restores too, as any execution config's does: a float16 run resumed from a bf16 or fp32
        checkpoint starts its loss scale afresh at `loss_scale_init`, and a run that does not
        scale drops a float16 checkpoint's scale. A run that trains less than the checkpoint did
        (`TrainSettings.trainable`) restores every parameter and the moments of what it trains."""
        from xlaopt.checkpoint import CheckpointError

        target = self.abstract_state
        manifest = manager.manifest(step)
        saved = any(leaf["name"].startswith(_SCALE_PREFIX) for leaf in manifest["leaves"])
        narrowed = manifest["meta"].get("trainable", "all") != self.program.settings.trainable
        if saved == (target.loss_scale is not None) and not narrowed:
            state, meta, _ = manager.restore(target, step=step)
            return state, meta
        if target.loss_scale is not None and not saved:  # partial restore keeps the target's values: real ones
            target = target._replace(loss_scale=jax.device_put(loss_scale.initial(self.program.execution),
                                                               self.state_shardings.loss_scale))
        state, meta, report = manager.restore(target, step=step, partial=True)
        # Only the loss scale may differ, and the frozen parameters' moments be left behind;
        # partial must not hide anything else (every leaf of this program's state is restored).
        dropped = lambda name: narrowed and name.startswith(_OPT_PREFIX)  # noqa: E731
        others = [n for n in report["kept_from_target"] if not n.startswith(_SCALE_PREFIX)] + \
                 [n for n in report["ignored"] if not (n.startswith(_SCALE_PREFIX) or dropped(n))]
        if others:
            raise CheckpointError(f"step {step}: the checkpoint's tree differs from this program's beyond the loss "
                                  f"scale: {', '.join(others[:8])}")
        return state, meta

    def _compile(self, lowered):
        program = self.program
        options = dict(program.compiler_options)
        if program.hlo_transforms:
            _check_transforms_run(program, self.mesh)
            marker = ",".join(f"{HLO_TRANSFORM_MARKER}{t.fingerprint()[:16]}" for t in program.hlo_transforms)
            options["xla_disable_hlo_passes"] = ",".join(filter(None, (str(options.get("xla_disable_hlo_passes", "")),
                                                                        marker)))
        platform = self.mesh.devices.flat[0].client.platform
        with _hlo_transforms(program, platform), compile_cache.written_by_every_process(platform), \
                compile_cache.reading_entries(f"{program.model.name}'s step"), compiler_log.captured() as log:
            try:
                compiled = lowered.compile(options)
            except Exception as e:  # XLA's own words on an option it does not know or cannot parse
                message = str(e)
                if "No such compile option" in message or "While setting option" in message:
                    raise UserError(f"compiler options {dict(program.compiler_options)}: XLA (jax "
                                    f"{jax.__version__}) says: {message.splitlines()[0]}") from None
                raise
        self.compiler_notes += [n for n in log.notes if n not in self.compiler_notes]
        return compiled


def check_batch_rows(program: TrainProgram, batch: dict) -> None:
    """attention=cudnn packs at most `attention_max_segments` samples a row (a static shape)."""
    execution, family = program.execution, family_of(program.model)
    if execution.attention == "cudnn" and family.attention_calls(batch):
        check_rows({k: batch[k] for k in family.segment_keys}, execution.attention_max_segments)


# Programs compiled in this process, newest last: a program hashes by value, so the CLI, the API, a
# planner and the tests asking for an equal program on the same devices share one set of compiled
# executables instead of tracing and compiling new closures each time.
_COMPILED: collections.OrderedDict[tuple, CompiledProgram] = collections.OrderedDict()
COMPILED_KEPT = 32


def compile_program(program: TrainProgram, mesh: jax.sharding.Mesh | None = None) -> CompiledProgram:
    """The program's `CompiledProgram` on `mesh` (default: `make_mesh(program.mesh)` over this
    process's devices), shared with every earlier call for an equal program and mesh."""
    _check_attention(program)
    key = (program, mesh if mesh is not None else tuple(d.id for d in jax.devices()))
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = CompiledProgram(program, mesh)
        while len(_COMPILED) > COMPILED_KEPT:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(key)
    return compiled


@contextlib.contextmanager
def _tracing_context(program: TrainProgram, mesh):
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.set_mesh(mesh))
        if program.shardings is not None and program.shardings.constrain_activations:
            def constrain(x, axes):
                manual = manual_axes()
                if manual:  # inside a shard_map over them: x is this device's part, on the other axes
                    spec = logical_to_spec(axes, x.shape, program.rules, program.mesh.inside_manual(manual),
                                           f"activation {axes}")
                    return jax.lax.with_sharding_constraint(x, spec)
                spec = logical_to_spec(axes, x.shape, program.rules, program.mesh, f"activation {axes}")
                return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

            stack.enter_context(activation_constraint(constrain))
        stack.enter_context(rows_split_over(batch_axes(program)))
        stack.enter_context(heads_split_over(head_axes(program)))
        yield


def _check_attention(program: TrainProgram) -> None:
    """cuDNN's attention on a context-split sequence runs only through Ulysses
    (`TrainProgram._check_cudnn_sequence`)."""
    if (program.execution.attention == "cudnn" and program.sequence_axes
            and not any(isinstance(t, UlyssesAttentionTransform) for t in program.grad_transforms)):
        raise UserError(f"execution setting attention=cudnn on a sequence split over "
                        f"{','.join(program.sequence_axes)} runs only through Ulysses attention; compile the "
                        f"program after the ulysses-attention pass (xlaopt's pass pipeline runs it)")


def _check_transforms_run(program: TrainProgram, mesh) -> None:
    """Refuse to compile where registered transforms would not run (see the module docstring)."""
    platform = mesh.devices.flat[0].platform
    if platform == "cpu":
        return
    try:
        live = set(jax.devices(platform))
    except RuntimeError:
        live = set()
    if mesh.devices.flat[0] not in live:
        names = ", ".join(t.name for t in program.hlo_transforms)
        raise UserError(f"HLO transforms ({names}) cannot run in a deviceless {platform.upper()} compile on jax "
                        f"{jax.__version__}: JAX registers them with a {platform} backend only when one starts, "
                        f"and a compile-only topology never starts one. Compile for the cpu target, or on a "
                        f"machine with the GPU, or drop the transforms")


@contextlib.contextmanager
def _hlo_transforms(program: TrainProgram, platform: str):
    from jax.extend import xla as jex_xla

    stages = {"pre-scheduler": jex_xla.PipelineStage.PRE_SCHEDULER,
              "post-scheduler": jex_xla.PipelineStage.POST_SCHEDULER}
    registered = []
    try:
        for t in program.hlo_transforms:
            stage = stages[t.stage]
            jex_xla.register_hlo_module_transformation(t.rewrite, name=t.registered_name, stage=stage,
                                                       platforms=[platform])
            registered.append((t.registered_name, stage))
        yield
    finally:
        for name, stage in registered:
            jex_xla.clear_hlo_module_transformation(name, stage=stage)

"""The training step: AdamW on fp32 master weights, the model in the compute dtype.

Under float16 the step scales its loss (`xlaopt.loss_scale`). A step whose gradients are not
all finite changes neither the parameters nor the optimizer state (so AdamW's own count, which
drives the learning-rate schedule and the bias correction, does not advance either), while
`TrainState.step` still advances: it counts the batches consumed, which the data position, the
noise key and the checkpoint step numbers follow, and a skipped batch is not retried.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from xlaopt import loss_scale
from xlaopt.compiler import trace_cache
from xlaopt.errors import UserError
from xlaopt.families import family_of
from xlaopt.mesh import DATA, MESH_AXES, STAGE
from xlaopt.models.fp8 import matmuls_in
from xlaopt.models.grad_sums import gradients_accumulated_in, gradients_scattered_by, gradients_summed_by
from xlaopt.models.layers import activation_constraint, manual_axes
from xlaopt.program import TrainProgram, TrainSettings, TrainState
from xlaopt.transforms import cast_once, weights_once
from xlaopt.transforms.hierarchical_grads import path_name
from xlaopt.transforms.micro_batches import accumulate, accumulate_manual, reduced_in, summed_in


def trained_part(program: TrainProgram, tree, is_leaf=None):
    """`tree` (shaped as the parameters: values, specs, shardings) with the leaves of the parameters
    `TrainSettings.trainable` freezes replaced by None, an empty subtree: the tree gradients, the
    optimizer and its state are over. Everything trained: `tree` itself."""
    prefixes = family_of(program.model).trainable_prefixes(program.settings.trainable)
    if prefixes is None:
        return tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return treedef.unflatten([leaf if (path_name(path) + "/").startswith(prefixes) else None for path, leaf in flat])


def with_trained(program: TrainProgram, trained, params):
    """`params` with the leaves of `trained` (a `trained_part` of them) in place of their own."""
    if family_of(program.model).trainable_prefixes(program.settings.trainable) is None:
        return trained
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([p if t is None else t for t, p in zip(treedef.flatten_up_to(trained), leaves)])


def make_optimizer(s: TrainSettings) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(0.0, s.learning_rate, max(s.warmup_steps, 1))
    # Norm scales and biases (1-D) are not decayed.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(optax.clip_by_global_norm(s.grad_clip),
                       optax.adamw(schedule, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay, mask=decay_mask))


def make_model(program: TrainProgram):
    return family_of(program.model).module(program.model, program.execution)


def make_init_model(program: TrainProgram):
    """The model that initialises the parameters. They do not depend on how attention is
    computed, and cuDNN's fused attention cannot be traced under the vmap over the layers'
    keys that initialises a stack (jax 0.10.2 batches it on the leading axis only), so a
    cudnn program initialises through dense attention (never run: only the parameters are kept)."""
    execution = program.execution
    if execution.attention == "cudnn":
        execution = dataclasses.replace(execution, attention="dense")
    return family_of(program.model).module(program.model, execution)


def model_loss(program: TrainProgram):
    """(model, loss(model, params, batch, key)): the family's loss, traced with the execution's
    matmul format (`xlaopt.models.fp8`) installed, and how a loop that sums the weights' gradients
    over data itself sums them (`summed_in`; a 1F1B pipeline's ticks) and, under ZeRO-1, leaves them."""
    loss, matmuls = family_of(program.model).loss, program.execution.matmuls
    summed = summed_in(program.execution.grad_reduce_dtype, program.target)
    accumulated, scattered = _accumulated_dtype(program), _scattered_over_data(program)

    def traced(*args):
        with (matmuls_in(matmuls), gradients_summed_by(summed), gradients_accumulated_in(accumulated),
              gradients_scattered_by(scattered)):
            return loss(*args)

    return make_model(program), traced


def _zero1_over_data(program: TrainProgram) -> bool:
    """Whether the optimizer's state is split over data replicas (ZeRO-1) on a layout that has them."""
    return program.execution.sharded_optimizer and program.shardings is not None and program.mesh.size(DATA) > 1


def _scattered_over_data(program: TrainProgram):
    """Under ZeRO-1, where a 1F1B pipeline's loop (manual over `stage` and `data`) leaves each stacked
    weight's gradient over data: reduce-scattered onto the moments' split (`sharding.data_scatter_specs`)."""
    if not _zero1_over_data(program):
        return None
    from xlaopt.sharding import data_scatter_specs

    specs = program.shardings.state.params
    return lambda path, params: data_scatter_specs(functools.reduce(lambda t, k: t[k], path, specs), params,
                                                   program.mesh)


def _shares_over_data(program: TrainProgram):
    """The same for the micro-batch loop manual over data: `params ->` each trained weight's split."""
    if not _zero1_over_data(program):
        return None
    from xlaopt.sharding import data_scatter_specs

    specs = trained_part(program, program.shardings.state.params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return lambda params: data_scatter_specs(specs, trained_part(program, params), program.mesh)


def batch_spec(program: TrainProgram) -> dict:
    return family_of(program.model).batch_spec(program.model, program.settings.batch)


def abstract_batch(program: TrainProgram) -> dict:
    return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d, _) in batch_spec(program).items()}


def base_grad_fn(program: TrainProgram, scale=None):
    """(params, batch with its draws, key) -> (loss, metrics, grads) (see `Family.draws`).
    With a loss `scale` (a scalar, traced or not) the loss is multiplied by it before it is
    differentiated and the fp32 gradients divided by it: the loss and gradients returned are
    the unscaled ones, and only the compute-dtype cotangents in between are scaled.
    The gradients are of the trained parameters only (`trained_part`): the frozen ones enter the
    loss as constants, so autodiff leaves out every backward that reaches no trained parameter."""
    model, loss_fn = model_loss(program)

    def grad_fn(params, batch, key):
        cast_once.note_loss(lambda p: loss_fn(model, p, batch, key)[0], params)

        def scaled_loss(trained):
            loss, metrics = loss_fn(model, with_trained(program, trained, params), batch, key)
            return (loss if scale is None else loss * scale), (loss, metrics)

        (_, (loss, metrics)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trained_part(program, params))
        grads = cast_once.widened(grads)  # a weight cast once (`weights_cast_once`): its cast's gradient
        return loss, metrics, (grads if scale is None else jax.tree.map(lambda g: g / scale, grads))

    return grad_fn


def why_rows_not_manual_over_data(program: TrainProgram) -> str | None:
    """Why the step cannot run manual over `data` (each rank its own rows with whole weights, its
    gradients reduced over data once, `accumulate_manual` and the hierarchical-grads pass), or
    None where it can."""
    from xlaopt.sharding import batch_axes, entry_axes

    if family_of(program.model).update_state is not None:
        return ("the model keeps batch statistics: manual over data each device would normalise with its own "
                "rows' moments, not the whole batch's")
    if DATA not in batch_axes(program):
        return "the rows are not split over the data axis"
    # XLA aborts the process (no message; CPU and GPU targets) compiling a shard_map manual over
    # data where tensor splits the work beside another axis: the micro-batch loop on
    # data=2,fsdp=2,tensor=2 or data=2,tensor=2,context=2, hierarchical-grads on data=4,fsdp=2,
    # tensor=2; data=4,tensor=2 and data=2,fsdp=2,context=2 compile (tests/test_stack.py). A
    # pipeline's stages are its own shard_map's and not checked here.
    beside = [a for a in MESH_AXES if a not in (DATA, "tensor", STAGE) and program.mesh.size(a) > 1]
    if program.mesh.size("tensor") > 1 and beside:
        return (f"tensor parallel beside {', '.join(beside)}: XLA aborts the process compiling a step manual "
                f"over data on this layout (jax {jax.__version__})")
    specs = jax.tree.leaves(program.shardings.state.params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if any(DATA in entry_axes(entry) for spec in specs for entry in spec):
        return "parameters are split over the data axis (ZeRO-3 style): their gradients are reduce-scattered"
    return None


def why_not_reduced_by_xlaopt(program: TrainProgram) -> str | None:
    """Why the step's data-parallel gradients are not reduced by xlaopt itself, once a step (XLA's
    partitioner places the reduction instead), or None where they are: after the micro-batch loop
    manual over data (`why_not_manual_loop`), or after a 1F1B pipeline's ticks, which run manual
    over data where it splits the rows (`xlaopt.models.pipeline_1f1b`)."""
    execution = program.execution
    if program.shardings is not None and execution.micro_batches == 1 and execution.layer_stack == "pipeline":
        from xlaopt.sharding import batch_axes

        if execution.pipeline_schedule != "1f1b" or program.mesh.size(STAGE) == 1:
            return ("one accumulation step a step (the pipeline's micro-batches run inside it), and the partitioner "
                    "reduces the gradients of the GPipe loop or of one stage")
        if DATA not in batch_axes(program):
            return "the rows are not split over the data axis"
        return None
    return why_not_manual_loop(program)


def why_not_manual_loop(program: TrainProgram) -> str | None:
    """Why the micro-batch loop does not run manual over data (`accumulate_manual`: each rank's
    gradients reduced once, after the last micro-batch), or None where it does: several
    micro-batches, a layout the rows can run manual over data in, and no grad transform that has
    taken data already."""
    if program.shardings is None:
        return "the program has no layout yet (run mesh-layout first)"
    if program.execution.micro_batches == 1 and program.execution.layer_stack == "pipeline":
        return ("one accumulation step a step (the pipeline's micro-batches run inside it): the partitioner reduces "
                "its gradients")
    if program.execution.micro_batches == 1:
        return "one micro-batch a step: the partitioner reduces each layer's gradients inside the backward"
    taken = next((t.name for t in program.grad_transforms if getattr(t, "axis", None) == DATA), None)
    if taken:
        return f"the grad transform {taken} reduces them over data"
    return why_rows_not_manual_over_data(program)


def _accumulates_manual_over(program: TrainProgram) -> str | None:
    """`data`, where the micro-batch loop runs manual over it (`accumulate_manual`)."""
    return None if why_not_manual_loop(program) else DATA


def build_grad_fn(program: TrainProgram, scale=None):
    """The step's gradient function: the weights its loss reads once, through a cast, cast once
    before the micro-batch loop (`xlaopt.transforms.cast_once`); each micro-batch's draws, then its
    gradients (its loss scaled by `scale`, when given) through the program's grad transforms, which
    see unscaled gradients and a micro-batch that holds its draws; then the micro-batches
    accumulated (manual over data where it can be, `accumulate_manual`)."""
    grad_fn = _accumulated_grad_fn(program, scale)
    dtypes = weights_cast_once(program)
    if all(d is None for d in jax.tree.leaves(dtypes, is_leaf=lambda x: x is None)):
        return grad_fn

    def cast_first(params, batch, key):
        return grad_fn(cast_once.cast(params, dtypes), batch, key)

    return cast_first


def weights_cast_once(program: TrainProgram):
    """The parameters' tree of the dtype each is cast to once a step, before the micro-batch loop
    (`xlaopt.transforms.cast_once`), or None where the step reads it as the model does; all None
    for one micro-batch a step, which has no loop to take the cast out of, or with the execution
    setting `cast_weights_once` off."""
    if program.execution.micro_batches == 1 or not program.execution.cast_weights_once:
        return jax.tree.map(lambda _: None, abstract_params_with_axes(program)[0])
    return _cast_dtypes(_traced_program(program))


@functools.lru_cache(maxsize=64)
def _cast_dtypes(program: TrainProgram):
    """`cast_once.cast_dtypes` of the step's loss, traced abstractly (no layout) where the step
    traces it (inside the grad transforms); on disk too, as the activations' trace is."""
    params, _ = abstract_params_with_axes(program)

    def trace():
        mesh = AbstractMesh(program.mesh.sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
        with jax.sharding.use_abstract_mesh(mesh), cast_once.probing() as seen:
            jax.eval_shape(_accumulated_grad_fn(program), params, abstract_batch(program), jax.random.key(0))
        if not seen:  # no loss traced through `base_grad_fn`: nothing known to be read once
            return [None] * len(jax.tree.leaves(params))
        dtypes = jax.tree.leaves(cast_once.cast_dtypes(seen[0], params), is_leaf=lambda x: x is None)
        return [None if d is None else str(d) for d in dtypes]

    names = trace_cache.cached("cast-once", program, trace)
    return jax.tree.unflatten(jax.tree.structure(params), [None if n is None else jnp.dtype(n) for n in names])


def _accumulated_grad_fn(program: TrainProgram, scale=None):
    family = family_of(program.model)
    fn = base_grad_fn(program, scale)
    for transform in program.grad_transforms:
        fn = transform.apply(fn)

    def with_draws(params, batch, key, fn=fn):
        return fn(params, family.with_draws(batch, key), key)

    axes = {name: spec[2] for name, spec in batch_spec(program).items()}
    reduce_dtype = program.execution.grad_reduce_dtype
    why_not = why_not_reduced_by_xlaopt(program)
    if why_not and reduce_dtype != "float32" and program.shardings is not None:  # (traced before layout too)
        raise UserError(f"execution setting grad_reduce_dtype={reduce_dtype}: xlaopt reduces data-parallel "
                        f"gradients itself only after the micro-batch loop manual over data or a 1F1B pipeline's "
                        f"ticks, and here {why_not}; leave it at float32")
    if not why_not_manual_loop(program):
        from xlaopt.sharding import batch_axes

        named = (*axes.items(), *family.draw_axes)
        rows = {name: list(a).index("batch") for name, a in named}
        seq = manual_sequence_axis(program)
        sequence = (seq, {name: list(a).index("seq") for name, a in named if "seq" in a}) if seq else None
        return accumulate_manual(fn, family.with_draws, program.execution.micro_batches, rows, DATA,
                                 tuple(a for a in batch_axes(program) if a not in (DATA, seq)),
                                 reduced_in(reduce_dtype, program.target), _holding(program), sequence,
                                 _accumulated_dtype(program), _shares_over_data(program))
    return accumulate(with_draws, program.execution.micro_batches, axes, _holding(program), _accumulated_dtype(program))


def _accumulated_dtype(program: TrainProgram) -> str | None:
    """The dtype the step's gradients are summed in over its micro-batches, where not float32
    (`grad_accumulate_dtype`), else None; refused where nothing is summed over them."""
    dtype = program.execution.grad_accumulate_dtype
    if dtype == "float32":
        return None
    why_not = why_not_accumulated_by_xlaopt(program)
    if why_not:
        raise UserError(f"execution setting grad_accumulate_dtype={dtype}: {why_not}; leave it at float32")
    return dtype


def why_not_accumulated_by_xlaopt(program: TrainProgram) -> str | None:
    """Why the step does not sum gradients over micro-batches itself, or None where it does: in its
    micro-batch loop, or in a 1F1B pipeline's ticks over several stages."""
    execution = program.execution
    if execution.micro_batches > 1:
        return None
    if execution.layer_stack != "pipeline":
        return "one micro-batch a step sums no gradients"
    if execution.pipeline_schedule != "1f1b" or program.mesh.size(STAGE) == 1:
        return "JAX's transpose of the GPipe loop (or of one stage) sums its micro-batches' gradients, in float32"
    return None


def manual_sequence_axis(program: TrainProgram) -> str | None:
    """The axis context parallelism splits the sequences over (Ulysses') where the micro-batch loop
    runs manual over it beside data, if any: a loop manual over data, in a family whose work
    outside attention reads each token alone (`Family.sequence_local`)."""
    axis = next((t.axis for t in program.grad_transforms if t.name == "ulysses-attention"), None)
    if axis is None or program.mesh.size(axis) == 1 or not family_of(program.model).sequence_local:
        return None
    return None if why_not_manual_loop(program) else axis


def _holding(program: TrainProgram):
    """`hold(values)` for the micro-batch loop's weights-only values (`accumulate`): each shaped as
    a parameter constrained to that parameter's layout, where one layout has that shape (left to
    the partitioner, they may be held whole). None with `weights_work_once` off, without fp8
    matmuls (nothing fp8 to hold, so no split to trace), and where the step recomputes: its
    backward's recomputed forward quantizes the weights again (JAX keeps the two apart), so the loop held two fp8 copies and their transposes, 13 GiB on Llama 3 8B, and under
    Megatron's selective recomputation on fsdp=8 the step went 11.17 -> 12.66 s, its peak 62.1 ->
    70.4 GiB (`experiments/cast_once.py --setting weights_work_once`)."""
    execution = program.execution
    if not execution.weights_work_once or execution.matmuls != "fp8" or execution.remat != "none":
        return None
    if program.shardings is None:
        return lambda held: held
    specs = jax.tree.leaves(program.shardings.state.params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return weights_once.in_layouts([w.shape for w in jax.tree.leaves(abstract_params_with_axes(program)[0])], specs)


def first_step_grad_fn(program: TrainProgram):
    """The gradient function of the program's first train step: under float16 its loss is
    scaled by `loss_scale_init`, as a fresh state's is (`CompiledProgram.grads`, `verify`)."""
    execution = program.execution
    return build_grad_fn(program, execution.loss_scale_init if loss_scale.uses_loss_scale(execution) else None)


def _onto_the_moments_split(program: TrainProgram, grads):
    """Under ZeRO-1 (`sharded_optimizer`) the gradients constrained to the moments' split over data
    (`sharding.over_data`), so the clip's norm and AdamW run on a replica's share. (XLA still
    all-reduces each layer's gradients inside the backward's layer loop and slices them here,
    rather than reduce-scattering: BENCHMARKS.md, "ZeRO-1".)"""
    if not program.execution.sharded_optimizer or program.shardings is None:
        return grads
    from jax.sharding import PartitionSpec

    from xlaopt.sharding import over_data

    specs = trained_part(program, program.shardings.state.params, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.tree.map(lambda g, spec: jax.lax.with_sharding_constraint(g, over_data(spec, g.shape, program.mesh)),
                        grads, specs)


def build_train_step(program: TrainProgram):
    opt = make_optimizer(program.settings)
    scaled = loss_scale.uses_loss_scale(program.execution)
    interval = program.execution.loss_scale_growth_interval

    family = family_of(program.model)

    def train_step(state: TrainState, batch, key):
        # Built inside the trace: under float16 it closes over this step's (traced) loss scale.
        grad_fn = build_grad_fn(program, state.loss_scale.value if scaled else None)
        loss, metrics, grads = grad_fn(state.params, batch, jax.random.fold_in(key, state.step))
        model_state = state.model_state
        if family.update_state is not None:
            model_state, metrics = family.update_state(program.model, model_state, metrics)
        trained = trained_part(program, state.params)
        grads = _onto_the_moments_split(program, grads)
        updates, opt_state = opt.update(grads, state.opt_state, trained)
        params = with_trained(program, optax.apply_updates(trained, updates), state.params)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        check = program.settings.nonfinite
        if not scaled and check != "skip":
            if check == "stop":
                metrics.update(nonfinite=_nonfinite(loss, params, opt_state))
            return TrainState(state.step + 1, params, opt_state, None, model_state), metrics
        # float16 skips a step whose gradients overflowed (the loss scale's own business);
        # "skip" also one whose loss or updated state is not finite (finite gradients can still
        # overflow AdamW's squared moments).
        finite = loss_scale.all_finite(grads)
        if check == "skip":
            finite &= ~_nonfinite(loss, params, opt_state).astype(bool)
        params, opt_state, model_state = loss_scale.keep_if(finite, (params, opt_state, model_state),
                                                            (state.params, state.opt_state, state.model_state))
        metrics.update(skipped=(~finite).astype(jnp.float32))
        if check == "stop":  # what a skipped step keeps is the state it started from
            metrics.update(nonfinite=_nonfinite(jnp.where(finite, loss, 0.0), params, opt_state))
        if not scaled:
            return TrainState(state.step + 1, params, opt_state, None, model_state), metrics
        metrics.update(loss_scale=state.loss_scale.value)
        scale = loss_scale.next_scale(state.loss_scale, finite, interval)
        return TrainState(state.step + 1, params, opt_state, scale, model_state), metrics

    return train_step


def _nonfinite(loss, params, opt_state):
    """1.0 when the loss or the updated state holds an inf or a nan."""
    return (~(jnp.isfinite(loss) & loss_scale.all_finite((params, opt_state)))).astype(jnp.float32)


def build_init(program: TrainProgram):
    model, opt = make_init_model(program), make_optimizer(program.settings)

    family = family_of(program.model)

    def init(key) -> TrainState:
        batch = {k: jnp.zeros(s, d) for k, (s, d, _) in batch_spec(program).items()}
        variables = model.init(key, batch)
        params = nn.meta.unbox(variables["params"])
        return TrainState(jnp.zeros((), jnp.int32), params, opt.init(trained_part(program, params)),
                          loss_scale.initial(program.execution),
                          family.init_state(variables))

    return init


@functools.lru_cache(maxsize=16)
def _abstract_boxed_params(program: TrainProgram):
    return jax.eval_shape(make_init_model(program).init, jax.random.key(0), abstract_batch(program))["params"]


def abstract_params_with_axes(program: TrainProgram):
    """(abstract params, logical PartitionSpec tree), built with jax.eval_shape: no allocation."""
    # Parameters depend on the model, batch shape and execution only; key the cache on those.
    boxed = _abstract_boxed_params(TrainProgram(program.model, settings=TrainSettings(program.settings.batch),
                                                execution=program.execution, target=program.target))
    return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_state(program: TrainProgram) -> TrainState:
    # The state depends on the model, settings, execution and target only: programs that differ in their
    # layout (every candidate of a planner, every mesh of a test) share one trace a process.
    return _abstract_state(TrainProgram(program.model, settings=program.settings, execution=program.execution,
                                        target=program.target))


@functools.lru_cache(maxsize=64)
def _abstract_state(program: TrainProgram) -> TrainState:
    return jax.eval_shape(build_init(program), jax.random.key(0))


def param_count(program: TrainProgram) -> int:
    params, _ = abstract_params_with_axes(program)
    return int(sum(np.prod(p.shape, dtype=np.int64) for p in jax.tree.leaves(params)))


def traced_activation_axes(program: TrainProgram) -> tuple[tuple[tuple[int, ...], tuple, tuple[str, ...]], ...]:
    """(shape, logical axes, manual mesh axes) of every activation the model constrains, found by
    tracing the gradient function abstractly with a recording constraint. Inside a rewrite's
    shard_map (manual axes named) the shape is one device's part along those axes."""
    return _traced_activation_axes(_traced_program(program))


def _traced_program(program: TrainProgram) -> TrainProgram:
    """What a trace of the gradient function reads: the model, settings, execution, grad transforms
    and the mesh's sizes (a rewrite's shard_map), not the layout; a pipeline run twice traces once a
    process."""
    return TrainProgram(program.model, program.mesh, settings=program.settings, execution=program.execution,
                        target=program.target, grad_transforms=program.grad_transforms)


@functools.lru_cache(maxsize=64)
def _traced_activation_axes(program: TrainProgram):
    # On disk too: a restarted process reads it instead of tracing (xlaopt.compiler.trace_cache).
    return trace_cache.cached("activations", program, lambda: _trace_activation_axes(program))


def _trace_activation_axes(program: TrainProgram):
    seen: dict = {}

    def record(x, axes):
        seen[(tuple(x.shape), axes, manual_axes())] = None
        return x

    params, _ = abstract_params_with_axes(program)
    # The program's mesh, abstractly (no devices needed), as when it is compiled: a rewrite that
    # traces shard_map finds its axes here too.
    mesh = AbstractMesh(program.mesh.sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    with activation_constraint(record), jax.sharding.use_abstract_mesh(mesh):
        jax.eval_shape(build_grad_fn(program), params, abstract_batch(program), jax.random.key(0))
    return tuple(seen)

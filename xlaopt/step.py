"""The training step: AdamW on fp32 master weights, the model in the compute dtype."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from xlaopt.families import family_of
from xlaopt.models.layers import activation_constraint
from xlaopt.program import TrainProgram, TrainSettings, TrainState


def make_optimizer(s: TrainSettings) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(0.0, s.learning_rate, max(s.warmup_steps, 1))
    # Norm scales and biases (1-D) are not decayed.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(optax.clip_by_global_norm(s.grad_clip),
                       optax.adamw(schedule, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay, mask=decay_mask))


def make_model(program: TrainProgram):
    return family_of(program.model).module(program.model, dtype=jnp.dtype(program.settings.compute_dtype))


def batch_spec(program: TrainProgram) -> dict:
    return family_of(program.model).batch_spec(program.model, program.settings.batch)


def abstract_batch(program: TrainProgram) -> dict:
    return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d, _) in batch_spec(program).items()}


def base_grad_fn(program: TrainProgram):
    """(params, batch, key) -> (loss, metrics, grads); any sampling in the loss uses `key`."""
    model, loss_fn = make_model(program), family_of(program.model).loss

    def grad_fn(params, batch, key):
        (loss, metrics), grads = jax.value_and_grad(functools.partial(loss_fn, model), has_aux=True)(
            params, batch, key)
        return loss, metrics, grads

    return grad_fn


def build_grad_fn(program: TrainProgram):
    fn = base_grad_fn(program)
    for transform in program.grad_transforms:
        fn = transform.fn(fn)
    return fn


def build_train_step(program: TrainProgram):
    grad_fn = build_grad_fn(program)
    opt = make_optimizer(program.settings)

    def train_step(state: TrainState, batch, key):
        loss, metrics, grads = grad_fn(state.params, batch, jax.random.fold_in(key, state.step))
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def build_init(program: TrainProgram):
    model, opt = make_model(program), make_optimizer(program.settings)

    def init(key) -> TrainState:
        batch = {k: jnp.zeros(s, d) for k, (s, d, _) in batch_spec(program).items()}
        params = nn.meta.unbox(model.init(key, batch)["params"])
        return TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))

    return init


@functools.lru_cache(maxsize=16)
def _abstract_boxed_params(program: TrainProgram):
    return jax.eval_shape(make_model(program).init, jax.random.key(0), abstract_batch(program))["params"]


def abstract_params_with_axes(program: TrainProgram):
    """(abstract params, logical PartitionSpec tree), built with jax.eval_shape: no allocation."""
    # Parameters depend on the model and dtype only; key the cache on those.
    boxed = _abstract_boxed_params(TrainProgram(program.model, settings=program.settings))
    return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_state(program: TrainProgram) -> TrainState:
    return jax.eval_shape(build_init(program), jax.random.key(0))


def param_count(program: TrainProgram) -> int:
    params, _ = abstract_params_with_axes(program)
    return int(sum(np.prod(p.shape, dtype=np.int64) for p in jax.tree.leaves(params)))


def traced_activation_axes(program: TrainProgram) -> list[tuple[tuple[int, ...], tuple]]:
    """(shape, logical axes) of every activation the model constrains, found by tracing
    the gradient function abstractly with a recording constraint."""
    seen: dict = {}

    def record(x, axes):
        seen[(tuple(x.shape), axes)] = None
        return x

    params, _ = abstract_params_with_axes(program)
    with activation_constraint(record):
        jax.eval_shape(build_grad_fn(program), params, abstract_batch(program), jax.random.key(0))
    return list(seen)

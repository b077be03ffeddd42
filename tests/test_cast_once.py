"""The weights cast once a step (`xlaopt.transforms.cast_once`): which parameters the analysis lets out of the
micro-batch loop, that no cast of them is left inside it, and that the gradients are bit for bit
those of the step that casts them at every read."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.data.batch import BatchShape
from xlaopt.data.synthetic_text import SyntheticText
from xlaopt.execution import ExecutionConfig
from xlaopt.models.registry import get_config
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.step import build_grad_fn, build_init, weights_cast_once
from xlaopt.transforms import cast_once

from conftest import SMALL

BF16 = ExecutionConfig(compute_dtype="bfloat16", micro_batches=2)


def _program(execution=BF16) -> TrainProgram:
    return TrainProgram(get_config("llama-tiny", SMALL), settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                        execution=execution)


def _named(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def test_the_projections_are_cast_once_and_the_embedding_and_norms_are_not():
    dtypes = _named(weights_cast_once(_program()))
    projections = {n for n in dtypes if n.endswith(("_proj_DHK", "_proj_DNK", "_proj_HKD", "_DF", "_FD"))}
    assert len(projections) == 7 and all(dtypes[n] == jnp.bfloat16 for n in projections), dtypes
    assert dtypes["lm_head_DE"] == jnp.bfloat16
    # Looked up in fp32 (its gradient a scatter-add, which bf16 would round), and norms' scales read in fp32.
    assert dtypes["embed_ED"] is None and all(v is None for n, v in dtypes.items() if n.endswith("scale")), dtypes
    for off in (dataclasses.replace(BF16, micro_batches=1), dataclasses.replace(BF16, cast_weights_once=False)):
        assert all(v is None for v in _named(weights_cast_once(_program(off))).values()), off


def _casts_to_bf16(jaxpr, shapes, inside_loop=False) -> list:
    """(inside a scan?, shape) of every cast to bf16 of an array shaped as one of `shapes`."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.bfloat16 \
                and tuple(eqn.invars[0].aval.shape) in shapes:
            found.append((inside_loop, tuple(eqn.invars[0].aval.shape)))
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _casts_to_bf16(inner, shapes, inside_loop or eqn.primitive.name == "scan")
    return found


def test_no_weight_is_cast_inside_the_micro_batch_loop_and_the_gradients_are_bit_for_bit_the_same():
    program = _program()
    key = jax.random.key(0)
    params = build_init(program)(key).params
    batch = SyntheticText(program.model, program.settings.batch, seed=0).batch(0)
    dtypes, values = _named(weights_cast_once(program)), _named(params)
    # A layer's weight is cast as the scan slices it; the head whole.
    shapes = {values[n].shape[n.startswith("layers/"):] for n, d in dtypes.items() if d is not None}
    once = build_grad_fn(program)
    # The rest of the weights' own work left in the loop too (`weights_once`), which would take the head's cast out.
    every_read = build_grad_fn(program.replace(execution=dataclasses.replace(BF16, cast_weights_once=False,
                                                                             weights_work_once=False)))
    assert {shape for inside, shape in _casts_to_bf16(jax.make_jaxpr(once)(params, batch, key).jaxpr, shapes)
            if inside} == set()
    assert {shape for inside, shape in _casts_to_bf16(jax.make_jaxpr(every_read)(params, batch, key).jaxpr, shapes)
            if inside} == shapes
    loss, _, grads = jax.jit(once)(params, batch, key)
    ref_loss, _, ref_grads = jax.jit(every_read)(params, batch, key)
    assert loss == ref_loss
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert got.dtype == want.dtype == jnp.float32
        np.testing.assert_array_equal(got, want)


def _analysed(loss, *params):
    return cast_once.cast_dtypes(jax.make_jaxpr(loss)(params).jaxpr, params)


W = jnp.ones((4, 4), jnp.float32)
X = jnp.ones((2, 4), jnp.bfloat16)


@jax.custom_vjp
def _hooked(w):
    return w


_hooked.defvjp(lambda w: (w, None), lambda _, g: (g * 2,))


@pytest.mark.parametrize("loss, cast", [
    (lambda p: (X @ p[0].astype(jnp.bfloat16)).sum(), (jnp.bfloat16,)),
    # through a reshape and a transpose, in a remat'd call
    (lambda p: jax.checkpoint(lambda w: (X @ w.T.reshape(4, 4).astype(jnp.bfloat16)).sum())(p[0]), (jnp.bfloat16,)),
    # a scan that slices it per iteration (a layer stack)
    (lambda p: jax.lax.scan(lambda c, w: (c @ w.astype(jnp.bfloat16), None), X, p[0].reshape(1, 4, 4))[0].sum(),
     (jnp.bfloat16,)),
    # read at every iteration of a scan: its cotangents summed there, in bf16 if cast before
    (lambda p: jax.lax.scan(lambda c, _: (c @ p[0].astype(jnp.bfloat16), None), X, None, length=2)[0].sum(), (None,)),
    # cast twice: two cotangents summed
    (lambda p: (X @ p[0].astype(jnp.bfloat16)).sum() + (X @ p[0].astype(jnp.bfloat16)).sum(), (None,)),
    # read uncast, beside the cast
    (lambda p: (X @ p[0].astype(jnp.bfloat16)).sum() + p[0].sum(), (None,)),
    # cast to two dtypes in a cond's branches
    (lambda p: jax.lax.cond(True, lambda w: w.astype(jnp.bfloat16).sum().astype(jnp.float32),
                            lambda w: w.astype(jnp.float16).sum().astype(jnp.float32), p[0]), (None,)),
    # one cast in each branch of a cond: one runs
    (lambda p: jax.lax.cond(True, lambda w: (X @ w.astype(jnp.bfloat16)).sum(),
                            lambda w: (X @ w.astype(jnp.bfloat16)).sum() * 2, p[0]), (jnp.bfloat16,)),
    # a custom derivative sees it first (a gradient hook): its backward may do anything with the dtype
    (lambda p: (X @ _hooked(p[0]).astype(jnp.bfloat16)).sum(), (None,)),
    # cast to a wider or the same dtype: nothing to save
    (lambda p: p[0].astype(jnp.float32).sum(), (None,)),
])
def test_a_parameter_is_cast_once_only_where_the_loss_reads_it_once_through_a_narrowing_cast(loss, cast):
    assert _analysed(loss, W) == cast

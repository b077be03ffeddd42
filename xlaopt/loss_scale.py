"""Dynamic loss scaling for float16 compute: the part of the train state that keeps small
gradients representable.

float16 has 5 exponent bits: values under 2^-24 flush to zero, and a backward pass's
activation cotangents (the loss's gradient divided over every token) easily fall that low. So
the loss is multiplied by `value` before it is differentiated, which lifts every cotangent by
the same factor, and the fp32 gradients are divided by it again. Too large a scale overflows
(an inf or a nan in some gradient): that step's update is skipped and the scale halves; after
`growth_interval` consecutive finite steps it doubles, to find the largest scale that fits.

The state is fp32 and int32 scalars in `TrainState.loss_scale`, so it checkpoints and resumes
with the run. bfloat16 (float32's exponent range) and float32 need no scaling: their state
holds None there, which is no leaf at all, so their checkpoints are what they were before
loss scaling existed.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# The one dtype whose exponent range needs a scaled loss.
SCALED_DTYPES = ("float16",)


class LossScale(NamedTuple):
    value: Any  # f32 scalar: the factor the loss is multiplied by before differentiation
    good_steps: Any  # i32 scalar: consecutive finite steps since the scale last changed


def uses_loss_scale(execution) -> bool:
    return execution.compute_dtype in SCALED_DTYPES


def initial(execution) -> LossScale | None:
    """The state a run starts from (None where the compute dtype needs no scaling)."""
    if not uses_loss_scale(execution):
        return None
    return LossScale(jnp.asarray(execution.loss_scale_init, jnp.float32), jnp.zeros((), jnp.int32))


def all_finite(tree) -> jax.Array:
    """True when no leaf of `tree` holds an inf or a nan."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def next_scale(scale: LossScale, finite, growth_interval: int) -> LossScale:
    """Halve on an overflow; double after `growth_interval` finite steps in a row. Both factors
    are powers of two, so dividing the gradients by any scale reached is exact."""
    good = jnp.where(finite, scale.good_steps + 1, 0)
    grow = good >= growth_interval
    value = jnp.where(finite, jnp.where(grow, scale.value * 2, scale.value), scale.value / 2)
    return LossScale(value.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32))


def keep_if(finite, new, old):
    """`new` where the step's gradients were finite, else `old`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

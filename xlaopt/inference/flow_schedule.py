"""Rectified-flow sampling in JAX: the sigma schedule and the Euler and Heun updates of diffusers'
`FlowMatchEulerDiscreteScheduler` and `FlowMatchHeunDiscreteScheduler` (static `shift`, no dynamic
shifting, no Karras/exponential/beta sigmas, no churn), as pure functions.

The model predicts the velocity v = dx/dsigma of x_sigma = (1 - sigma) * x_0 + sigma * noise; sampling
integrates from sigma = 1 (noise) down to sigma = 0.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.errors import UserError

MAX_STEPS = 1000

VelocityFn = Callable[[jax.Array, jax.Array], jax.Array]  # (x[...], sigma[]) -> velocity[...]


@dataclasses.dataclass(frozen=True)
class FlowSchedule:
    steps: int
    shift: float = 1.0
    num_train_timesteps: int = 1000

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= MAX_STEPS:
            raise UserError(f"steps {self.steps!r}: the step count must be an integer in [1, {MAX_STEPS}]")
        if not self.shift > 0:  # also refuses NaN
            raise UserError(f"shift {self.shift!r}: the schedule shift must be a number > 0")
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, int) \
                or self.num_train_timesteps < 1:
            raise UserError(f"num_train_timesteps {self.num_train_timesteps!r}: must be an integer >= 1")

    def _shifted(self, s):
        return self.shift * s / (1 + (self.shift - 1) * s)

    def sigmas(self) -> np.ndarray:
        """sigmas[steps + 1], float32, from 1 down to 0: diffusers' `scheduler.sigmas` after `set_timesteps`."""
        n = self.num_train_timesteps
        # diffusers' constructor shifts its float32 training grid (1/n .. 1) first, and `set_timesteps`
        # spaces the steps between the ends of that already shifted grid and then shifts again: the
        # last nonzero sigma is shifted twice. Reproduced, float32 then float64, so the values are equal.
        ends_f32 = self._shifted(np.array([n, 1], np.float32) / np.float32(n)).astype(np.float32)
        sigma_max, sigma_min = (float(e) for e in ends_f32)
        sigmas_f64 = np.linspace(sigma_max * n, sigma_min * n, self.steps) / n
        return np.append(self._shifted(sigmas_f64).astype(np.float32), np.float32(0))

    def timesteps(self) -> np.ndarray:
        """timesteps[steps], float32: diffusers' Euler `scheduler.timesteps` (Heun's repeats all but the first)."""
        return self.sigmas()[:-1] * np.float32(self.num_train_timesteps)


def euler_step(x: jax.Array, velocity: jax.Array, sigma, sigma_next) -> jax.Array:
    """One first-order step from sigma to sigma_next; the same float32 arithmetic as diffusers' Euler step."""
    dt = jnp.float32(sigma_next) - jnp.float32(sigma)
    # diffusers upcasts the sample for the update and casts the result to the model's dtype.
    return (x.astype(jnp.float32) + dt * velocity.astype(jnp.float32)).astype(velocity.dtype)


def heun_step(velocity_fn: VelocityFn, x: jax.Array, sigma, sigma_next) -> jax.Array:
    """One Heun step (two model calls): an Euler predictor, then the corrector averaging both velocities.

    The step to sigma_next == 0 stays first order, as in diffusers, whose schedule has no corrector
    call there. `sigma_next` must be concrete (a schedule value, not traced): it chooses the branch.
    """
    velocity = velocity_fn(x, jnp.float32(sigma))
    x_pred = euler_step(x, velocity, sigma, sigma_next)
    if sigma_next == 0:
        return x_pred
    velocity_next = velocity_fn(x_pred, jnp.float32(sigma_next))
    dt = jnp.float32(sigma_next) - jnp.float32(sigma)
    velocity_mean = jnp.float32(0.5) * (velocity.astype(jnp.float32) + velocity_next.astype(jnp.float32))
    return (x.astype(jnp.float32) + dt * velocity_mean).astype(velocity_next.dtype)


def sample(velocity_fn: VelocityFn, x_T: jax.Array, schedule: FlowSchedule, order: int = 1) -> jax.Array:
    """x_0 from the noise x_T over `schedule`: order 1 is Euler (steps model calls), 2 Heun (2 * steps - 1)."""
    if order not in (1, 2):
        raise UserError(f"order {order!r}: the sampler order must be 1 (Euler) or 2 (Heun)")
    sigmas = [float(s) for s in schedule.sigmas()]
    # A Python loop over host floats: a jitted velocity_fn compiles once (sigma is traced, not static).
    x = x_T
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        if order == 1:
            x = euler_step(x, velocity_fn(x, jnp.float32(sigma)), sigma, sigma_next)
        else:
            x = heun_step(velocity_fn, x, sigma, sigma_next)
    return x

"""xlaopt.inference.flow_schedule against diffusers' flow-matching Euler and Heun schedulers."""
import jax.numpy as jnp
import numpy as np
import pytest

from xlaopt.errors import UserError
from xlaopt.inference.flow_schedule import FlowSchedule, euler_step, heun_step, sample

SHAPE = (2, 3, 4)


def _diffusers():
    """(torch, diffusers.schedulers), or a skip: only the comparisons need them."""
    return pytest.importorskip("torch"), pytest.importorskip("diffusers.schedulers")


def _euler_scheduler(s: FlowSchedule):
    _, schedulers = _diffusers()
    sched = schedulers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=s.num_train_timesteps, shift=s.shift)
    sched.set_timesteps(s.steps)
    return sched


@pytest.mark.parametrize("steps, shift, n", [(10, 1.0, 1000), (50, 3.0, 1000), (1, 5.0, 1000), (7, 1.0, 500),
                                             (13, 1.7, 1000)])
def test_schedule_equals_diffusers(steps, shift, n):
    _, schedulers = _diffusers()
    s = FlowSchedule(steps, shift, n)
    sched = _euler_scheduler(s)
    sigmas, timesteps = s.sigmas(), s.timesteps()
    assert sigmas.dtype == timesteps.dtype == np.float32 and sigmas.shape == (steps + 1,) and sigmas[-1] == 0
    # Exact: the same float32/float64 operations in the same order, so the same bits.
    np.testing.assert_array_equal(sigmas, sched.sigmas.numpy())
    np.testing.assert_array_equal(timesteps, sched.timesteps.numpy())
    # Heun lays the same values out for its two calls a step: sigmas s0, s1, s1, ..., s_{n-1}, s_{n-1}, 0
    # and timesteps t0, t1, t1, ..., t_{n-1}, t_{n-1} (no corrector call for the step to 0).
    heun = schedulers.FlowMatchHeunDiscreteScheduler(num_train_timesteps=n, shift=shift)
    heun.set_timesteps(steps)
    np.testing.assert_array_equal(heun.sigmas.numpy(), np.concatenate([sigmas[:1], np.repeat(sigmas[1:-1], 2), [0]]))
    np.testing.assert_array_equal(heun.timesteps.numpy(), np.concatenate([timesteps[:1], np.repeat(timesteps[1:], 2)]))


def test_euler_step_equals_diffusers():
    torch, _ = _diffusers()
    s = FlowSchedule(10, shift=3.0)
    sched, sigmas = _euler_scheduler(s), s.sigmas()
    rng = np.random.default_rng(0)
    for i, t in enumerate(sched.timesteps):
        x, velocity = rng.standard_normal((2, *SHAPE), dtype=np.float32)
        want = sched.step(torch.from_numpy(velocity), t, torch.from_numpy(x)).prev_sample.numpy()
        # Exact: dt = sigma_next - sigma and x + dt * v, each rounded to float32 as torch rounds it.
        np.testing.assert_array_equal(np.asarray(euler_step(jnp.asarray(x), jnp.asarray(velocity),
                                                            sigmas[i], sigmas[i + 1])), want)


C = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)


def _velocity(x, sigma, target):
    """A linear field in x and sigma, the same expression for torch and for jnp arrays."""
    return 0.8 * x - (1 + sigma) * target


@pytest.mark.parametrize("order, cls", [(1, "FlowMatchEulerDiscreteScheduler"), (2, "FlowMatchHeunDiscreteScheduler")])
def test_sample_equals_diffusers_loop(order, cls):
    torch, schedulers = _diffusers()
    s = FlowSchedule(12, shift=3.0)
    x_T = np.random.default_rng(2).standard_normal(SHAPE, dtype=np.float32)
    sched = getattr(schedulers, cls)(shift=s.shift)
    sched.set_timesteps(s.steps)
    x = torch.from_numpy(x_T)
    # The documented loop; for Heun, scheduler.timesteps already holds each step's second call.
    for t in sched.timesteps:
        x = sched.step(_velocity(x, t / 1000, torch.from_numpy(C)), t, x).prev_sample
    got = sample(lambda x, sigma: _velocity(x, sigma, jnp.asarray(C)), jnp.asarray(x_T), s, order=order)
    assert got.shape == SHAPE and got.dtype == jnp.float32
    if order == 1:  # exact: here t / 1000 gives back each sigma's float32 bits, and the steps are euler_step's
        np.testing.assert_array_equal(np.asarray(got), x.numpy())
    else:
        # Heun's scheduler takes the derivative as (x - (x - v * sigma)) / sigma, not v: a rounding of about
        # one ulp of x per call (~2.4e-7 at |x| ~ 2.5). Seen: 1.2e-6 after the 23 calls; doing that round
        # trip here too brings it under 1e-8, so the bound is the rounding, not a difference in the method.
        np.testing.assert_allclose(np.asarray(got), x.numpy(), rtol=0, atol=1e-5)


def test_heun_is_second_order():
    # dx/dsigma = x - c from x_T at sigma = 1 gives x_0 = c + (x_T - c) / e.
    c, x_T = jnp.float32(0.5), jnp.full(SHAPE, 2.0, jnp.float32)
    exact = c + (x_T - c) / np.e
    err = {(order, steps): float(jnp.max(jnp.abs(sample(lambda x, _: x - c, x_T, FlowSchedule(steps), order) - exact)))
           for order in (1, 2) for steps in (8, 15)}
    # steps sigmas from 1 to 1e-3 make steps - 1 equal intervals (then a last, Euler, step to 0): 8 and 15
    # steps halve the interval, which halves Euler's error and quarters Heun's.
    assert 1.8 < err[1, 8] / err[1, 15] < 2.2
    assert 3.6 < err[2, 8] / err[2, 15] < 4.4
    # heun_step's single step to 0 is Euler's.
    x = jnp.asarray(C)
    np.testing.assert_array_equal(heun_step(lambda x, _: x - c, x, 0.25, 0.0), euler_step(x, x - c, 0.25, 0.0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), r"steps 0: .*\[1, 1000\]"),
    (dict(steps=1001), r"steps 1001: .*\[1, 1000\]"),
    (dict(steps=10, shift=0), r"shift 0: .*> 0"),
    (dict(steps=10, shift=-1.0), r"shift -1.0: .*> 0"),
])
def test_bad_schedule_is_a_user_error(kwargs, match):
    with pytest.raises(UserError, match=match):
        FlowSchedule(**kwargs)

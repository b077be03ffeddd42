"""Sampling a trained generator: noise schedules and ODE integrators."""

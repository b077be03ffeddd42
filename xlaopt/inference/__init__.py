"""Inference: KV-cached text decoding, and sampling a trained generator (noise schedules, ODE integrators)."""

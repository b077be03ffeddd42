"""xlaopt: a JAX/XLA compiler-pass toolkit for training and serving large multimodal models.

The Python API (`xlaopt.api`) is importable without starting JAX; see its docstring.
"""
from xlaopt.api import (
           analyze,
           build_program,
           compile_program,
           optimize,
           parse_topology,
           show,
           simulated_devices,
           train,
           verify,
)

__all__ = ["analyze", "build_program", "compile_program", "optimize", "parse_topology", "show", "simulated_devices",
           "train", "verify"]

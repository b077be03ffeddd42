"""Rewrites a program carries into tracing and compilation, compared by value.

A transform is a frozen dataclass: its class names the rewrite and its fields are the
rewrite's parameters, so two transforms built separately from the same parameters are equal
and hash alike, and a pass that builds its transform again leaves the program unchanged.
  - `GradTransform.apply(grad_fn) -> grad_fn`: a traced-function rewrite (shard_map,
    collective reordering), applied in order to one micro-batch's gradient function, whose
    batch holds its random draws already (`xlaopt.step.build_grad_fn`);
  - `HloTransform.rewrite(module_proto) -> bytes | None`: a compiled-HLO rewrite, run by XLA
    before or after its scheduler (`jax.extend.xla.register_hlo_module_transformation`).
Compiler options are `CompilerOptions` (`compiler_options.py`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Callable, ClassVar

STAGES = ("pre-scheduler", "post-scheduler")


@dataclasses.dataclass(frozen=True)
class GradTransform:
    name: ClassVar[str] = ""

    def apply(self, grad_fn: Callable) -> Callable:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class HloTransform:
    name: ClassVar[str] = ""
    stage: str = "pre-scheduler"

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"{type(self).__name__}: stage {self.stage!r}; use one of {', '.join(STAGES)}")

    def rewrite(self, module_proto: bytes) -> bytes | None:
        """A serialized HloModuleProto in; the rewritten one out, or None when nothing changed."""
        raise NotImplementedError

    @property
    def registered_name(self) -> str:
        return f"{self.name}-{self.fingerprint()[:12]}"

    def fingerprint(self) -> str:
        """Changes with the parameters and with the rewrite's code, so an executable compiled
        under this transform is never mistaken for one compiled under another."""
        cls = type(self)
        try:
            code = inspect.getsource(cls)
        except (OSError, TypeError):  # defined where no source file is kept (python -c, some REPLs)
            code = repr([(f.__code__.co_code, f.__code__.co_consts) for f in vars(cls).values()
                         if hasattr(f, "__code__")])
        return hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}|{self!r}|{code}".encode()).hexdigest()

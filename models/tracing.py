"""Values a rewrite installs for the time a model is traced (the models' seams read them)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator


@contextlib.contextmanager
def installed(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """`var` holds `value` inside the block and its previous value again after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)

"""XLA compiler options (DebugOptions overrides) as a sorted, hashable mapping.

Order never matters (two programs with the same options are equal), a key given twice with
different values is an error rather than a silent winner, and options that belong to another
target's compiler (`xla_gpu_*` for a CPU program, `xla_cpu_*` for a GPU one) are refused.
Whether an option exists is XLA's to say: an unknown name or a badly typed value fails the
compile, and `xlaopt.compile` turns that error into one line naming the option.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Iterator, Union

from xlaopt.errors import UserError

Value = Union[bool, int, float, str]
_TARGET_PREFIXES = {"cpu": "xla_cpu_", "gpu": "xla_gpu_"}


def parse_value(raw: str) -> Value:
    """A command-line value typed as XLA expects: booleans and numbers are not strings to it."""
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


class CompilerOptions(Mapping):
    __slots__ = ("_items",)

    def __init__(self, options: Mapping[str, Value] | Iterable[tuple[str, Value]] = ()):
        pairs = options.items() if isinstance(options, Mapping) else options
        merged: dict[str, Value] = {}
        for key, value in pairs:
            if not isinstance(key, str) or not key.startswith("xla_"):
                raise UserError(f"compiler option {key!r}: XLA options are named xla_..., e.g. "
                                f"xla_gpu_enable_latency_hiding_scheduler")
            if key in merged and merged[key] != value:
                raise UserError(f"compiler option {key} is given twice, as {merged[key]!r} and {value!r}; keep one")
            merged[key] = value
        self._items = tuple(sorted(merged.items()))

    @classmethod
    def parse(cls, items: Iterable[str]) -> "CompilerOptions":
        """`key=value` strings (the CLI's `--xla-option`)."""
        pairs = []
        for item in items:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise UserError(f"--xla-option {item!r}: expected key=value, e.g. --xla-option "
                                f"xla_cpu_enable_fast_math=false")
            pairs.append((key.strip(), parse_value(raw)))
        return cls(pairs)

    def merged(self, other: Mapping[str, Value]) -> "CompilerOptions":
        return CompilerOptions(list(self._items) + list(other.items()))

    def check_target(self, target: str) -> None:
        for key in self:
            for other, prefix in _TARGET_PREFIXES.items():
                if other != target and key.startswith(prefix):
                    raise UserError(f"compiler option {key} is for XLA's {other.upper()} compiler; this program "
                                    f"compiles for {target} (options for it start with {_TARGET_PREFIXES[target]} "
                                    f"or are shared, xla_...)")

    def __getitem__(self, key: str) -> Value:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        if isinstance(other, CompilerOptions):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"CompilerOptions({dict(self._items)!r})"

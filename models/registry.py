"""Model configs registered by name, and typed `--set key=value` overrides.

Each registered name holds a config class (a frozen dataclass with a `family` class
attribute) and the spec it is built from. Overrides always apply to the spec, never to a
resolved config, so derived fields re-derive unless they are set too.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any, get_type_hints

from xlaopt.errors import UserError

# Modules whose import registers their variants; listed here so lookups see every family.
_CONFIG_MODULES = ("xlaopt.models.cosmos3_config", "xlaopt.models.decoder", "xlaopt.models.vit",
                   "xlaopt.models.resnet")
_REGISTRY: dict[str, tuple[type, dict[str, Any]]] = {}


class ConfigError(UserError):
    """A config or override that cannot describe a model; the message says how to fix it."""


def register(name: str, config_cls: type, **spec: Any) -> None:
    if name in _REGISTRY:
        raise ConfigError(f"model {name!r} is registered twice")
    config_cls(name=name, **spec)  # validate at registration time
    _REGISTRY[name] = (config_cls, spec)


def _loaded() -> dict[str, tuple[type, dict[str, Any]]]:
    for module in _CONFIG_MODULES:
        importlib.import_module(module)
    return _REGISTRY


def registered_models() -> tuple[str, ...]:
    return tuple(_loaded())


def config_class(name: str) -> type:
    registry = _loaded()
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown model {name!r}; {hint}registered: {', '.join(registry)}")
    return registry[name][0]


def _field_types(config_cls: type) -> dict[str, Any]:
    hints = get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls) if f.name != "name"}


def get_config(name: str, overrides: dict[str, Any] | None = None):
    """The registered config `name` with `overrides` (already typed) applied to its spec."""
    config_cls = config_class(name)
    fields = _field_types(config_cls)
    for key in overrides or {}:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config field {key!r}{hint}; fields: {', '.join(sorted(fields))}")
    return config_cls(name=name, **{**_REGISTRY[name][1], **(overrides or {})})


def parse_overrides(name: str, items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Parse `key=value` strings for model `name` into values typed by its config's fields."""
    return parse_assignments(items, _field_types(config_class(name)), "--set", "config field",
                             "--set num_layers=2")


def parse_assignments(items, fields: dict[str, Any], flag: str, what: str, example: str) -> dict[str, Any]:
    """`key=value` strings typed by `fields` (name -> type hint): the one parser behind the
    command line's `--set`, `--exec` and `--pass-option`. `what` names a key in errors."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r}: expected key=value, e.g. {example}")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{flag} {item!r}: unknown {what} {key!r}{hint}; valid: {', '.join(fields) or '(none)'}")
        out[key] = _parse_value(flag, key, raw.strip(), fields[key])
    return out


def _parse_value(flag: str, key: str, raw: str, hint: Any) -> Any:
    text = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    try:
        if "tuple" in text:
            return tuple(int(v) for v in raw.replace("(", "").replace(")", "").split(",") if v.strip())
        if "bool" in text:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "int" in text:
            return None if raw.lower() == "none" and "None" in text else int(raw)
        if "float" in text:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{flag} {key}={raw!r}: not a valid {text}") from None

"""Layout files: how one run is laid out, as one reviewable, reusable file.

`--mesh` names only axis sizes and keeps the default rule table (`xlaopt.sharding`); a
layout file says everything a planner decides, so a layout found by hand or by `xlaopt plan`
can be priced (`xlaopt analyze --layout`), trained, verified, diffed and re-planned:

    # layout.toml
    model = "cosmos3-nano"          # optional: what it was planned for (checked when given)
    topology = "h100:16x8"          # optional: the cluster it was planned for (checked by analyze)
    mesh = { data = 16, fsdp = 8 }
    # Optional: the mesh axes from outermost to innermost over the devices (numbered node-major);
    # the last ones stay inside a node. Default: data, fsdp, tensor, context.
    order = ["data", "fsdp", "context", "tensor"]
    # Optional; ordered: for each array dimension the first rule naming its logical axis whose
    # mesh axes are still free wins. Omitted: the default table.
    rules = [
      ["batch", ["data", "fsdp"]],
      ["embed", ["fsdp"]],
      ["heads", ["tensor"]],
    ]
    # Optional: the global batch it was planned for (rows, and a row's text and generator
    # tokens; a decoder's sequence is text_len). Command-line sizes override it.
    batch = { batch_size = 128, text_len = 896, gen_len = 44160 }
    # Optional: the execution config (`xlaopt.execution`); `--exec` applies on top of it.
    execution = { remat = "full", attention = "cudnn", micro_batches = 1, compute_dtype = "bfloat16" }

JSON with the same keys works too (`.json`). Rules are a list of pairs, not a table,
because their order decides ties.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib
from typing import get_type_hints

from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MESH_AXES, MeshError, MeshSpec
from xlaopt.sharding import DEFAULT_RULES, Rule, validate_rules

KEYS = ("model", "topology", "mesh", "order", "rules", "batch", "execution")


class LayoutError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: MeshSpec  # its sizes and its order over the devices
    rules: tuple[Rule, ...] = DEFAULT_RULES
    batch: BatchShape | None = None  # the global batch it was planned for
    execution: ExecutionConfig | None = None
    model: str | None = None  # the registered model it was planned for
    topology: str | None = None  # the topology it was planned for (`h100:16x8`)

    def to_json(self) -> dict:
        out: dict = {}
        if self.model is not None:
            out["model"] = self.model
        if self.topology is not None:
            out["topology"] = self.topology
        out["mesh"] = {a: s for a, s in self.mesh.as_dict().items() if s > 1} or {"data": 1}
        if self.mesh.order != MESH_AXES:
            out["order"] = list(self.mesh.order)
        out["rules"] = [[logical, list(axes)] for logical, axes in self.rules]
        if self.batch is not None:
            out["batch"] = dataclasses.asdict(self.batch)
        if self.execution is not None:
            default = ExecutionConfig()
            out["execution"] = {f.name: getattr(self.execution, f.name) for f in dataclasses.fields(ExecutionConfig)
                                if getattr(self.execution, f.name) != getattr(default, f.name)}
        return out

    def check_model(self, name: str, where: str = "layout") -> None:
        if self.model is not None and self.model != name:
            raise LayoutError(f"{where} was planned for model {self.model}, not {name}; pass --model {self.model} "
                              f"or plan one for {name} (xlaopt plan --model {name} ...)")

    def check_topology(self, name: str, where: str = "layout") -> None:
        if self.topology is not None and self.topology != name:
            raise LayoutError(f"{where} was planned for topology {self.topology}, not {name}; price it on "
                              f"{self.topology}, or re-plan: xlaopt plan --from {where} --topology {name}")


def parse_layout(data: dict, where: str) -> Layout:
    if not isinstance(data, dict):
        raise LayoutError(f"{where}: a layout is a table with keys {', '.join(KEYS)}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise LayoutError(f"{where}: unknown keys {unknown}; a layout has {', '.join(KEYS)}")
    mesh = data.get("mesh")
    if not isinstance(mesh, dict) or not mesh:
        raise LayoutError(f"{where}: missing field 'mesh', e.g. mesh = {{ data = 2, fsdp = 4 }}")
    bad = [f"{a}={s!r}" for a, s in mesh.items() if not (isinstance(s, int) and not isinstance(s, bool))]
    if bad:
        raise LayoutError(f"{where}: mesh sizes must be integers: {', '.join(bad)}")
    try:
        spec = MeshSpec.parse(",".join(f"{a}={s}" for a, s in mesh.items()))
        if "order" in data:
            order = data["order"]
            if not (isinstance(order, list) and all(isinstance(a, str) for a in order)):
                raise MeshError(f"order = {order!r}: a list of mesh axis names, outermost first")
            spec = spec.with_order(order)
    except MeshError as e:
        raise LayoutError(f"{where}: {e}") from None
    extras = {"batch": _typed_table(data, "batch", BatchShape, where),
              "execution": _typed_table(data, "execution", ExecutionConfig, where)}
    for key in ("model", "topology"):
        if key in data and not isinstance(data[key], str):
            raise LayoutError(f"{where}: {key} = {data[key]!r} must be a string")
        extras[key] = data.get(key)
    if "rules" not in data:
        return Layout(spec, **extras)
    rules = []
    for i, rule in enumerate(data["rules"] if isinstance(data["rules"], list) else [None]):
        ok = (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)
              and isinstance(rule[1], list) and all(isinstance(a, str) for a in rule[1]))
        if not ok:
            raise LayoutError(f"{where}: rules[{i}] = {rule!r}; each rule is [logical axis, [mesh axes...]], "
                              f"e.g. [\"embed\", [\"fsdp\"]] (mesh axes: {', '.join(MESH_AXES)})")
        rules.append((rule[0], tuple(rule[1])))
    try:
        validate_rules(rules)
    except MeshError as e:
        raise LayoutError(f"{where}: {e}") from None
    return Layout(spec, tuple(rules), **extras)


def _typed_table(data: dict, key: str, cls: type, where: str):
    """`data[key]` as a `cls` (a frozen dataclass), each field's type checked; None if absent."""
    if key not in data:
        return None
    table = data[key]
    hints = {f.name: get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
    if not isinstance(table, dict):
        raise LayoutError(f"{where}: {key} must be a table of {', '.join(hints)}")
    unknown = sorted(set(table) - set(hints))
    if unknown:
        raise LayoutError(f"{where}: {key} has unknown fields {unknown}; its fields are {', '.join(hints)}")
    for name, value in table.items():
        kind = hints[name]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise LayoutError(f"{where}: {key}.{name} = {value!r} must be {getattr(kind, '__name__', kind)}")
    try:
        return cls(**table)
    except UserError as e:
        raise LayoutError(f"{where}: {key}: {e}") from None


def load_layout(path: str | pathlib.Path) -> Layout:
    path = pathlib.Path(path)
    if path.is_dir():
        raise LayoutError(f"layout file {path} is a directory; give the file, e.g. {path / 'layout.toml'}")
    if not path.is_file():
        raise LayoutError(f"layout file {path} does not exist")
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LayoutError(f"{path}: not {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}") from None
    except OSError as e:
        raise LayoutError(f"layout file {path}: cannot read: {e.strerror}") from None
    return parse_layout(data, str(path))


def save_layout(layout: Layout, path: str | pathlib.Path) -> None:
    """JSON, or TOML when the name ends in `.toml`."""
    path = pathlib.Path(path)
    data = layout.to_json()
    path.write_text(to_toml(data) if path.suffix == ".toml" else json.dumps(data, indent=2) + "\n")


def to_toml(data: dict) -> str:
    """A layout's plain data as TOML (strings, numbers, booleans, lists and one level of inline
    tables: all a layout holds). tomllib reads TOML but does not write it."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(f"cannot write {v!r} as TOML")

    lines = []
    for key, v in data.items():
        if key == "rules":
            lines += ["rules = ["] + [f"  {value(rule)}," for rule in v] + ["]"]
        else:
            lines.append(f"{key} = {value(v)}")
    return "\n".join(lines) + "\n"

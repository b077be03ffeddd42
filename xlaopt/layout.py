"""Layout files: a mesh and the logical-axis rule table, as one reviewable, reusable file.

`--mesh` names only axis sizes and keeps the default rule table (`xlaopt.sharding`); a
layout file also says which mesh axes each logical axis shards over, so a layout found by
hand or by a planner can be priced (`xlaopt analyze --layout`), trained and diffed:

    # layout.toml
    mesh = { data = 2, fsdp = 64, tensor = 8 }
    # Optional; ordered: for each array dimension the first rule naming its logical axis
    # whose mesh axes are still free wins. Omitted: the default table.
    rules = [
      ["batch", ["data", "fsdp"]],
      ["embed", ["fsdp"]],
      ["heads", ["tensor"]],
    ]

JSON with the same keys works too (`.json`). Rules are a list of pairs, not a table,
because their order decides ties.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib

from xlaopt.errors import UserError
from xlaopt.mesh import MESH_AXES, MeshError, MeshSpec
from xlaopt.sharding import DEFAULT_RULES, Rule, validate_rules

KEYS = ("mesh", "rules")


class LayoutError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: MeshSpec
    rules: tuple[Rule, ...] = DEFAULT_RULES

    def to_json(self) -> dict:
        return {"mesh": {a: s for a, s in self.mesh.as_dict().items() if s > 1},
                "rules": [[logical, list(axes)] for logical, axes in self.rules]}


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
    except MeshError as e:
        raise LayoutError(f"{where}: {e}") from None
    if "rules" not in data:
        return Layout(spec)
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
    return Layout(spec, tuple(rules))


def load_layout(path: str | pathlib.Path) -> Layout:
    path = pathlib.Path(path)
    if not path.is_file():
        raise LayoutError(f"layout file {path} does not exist")
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LayoutError(f"{path}: not {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}") from None
    return parse_layout(data, str(path))


def save_layout(layout: Layout, path: str | pathlib.Path) -> None:
    pathlib.Path(path).write_text(json.dumps(layout.to_json(), indent=2) + "\n")

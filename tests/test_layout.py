"""Layout files: a mesh plus the rule table, read from TOML/JSON, used by `analyze --layout`;
every malformed file named clearly."""
import json

import pytest

from xlaopt.cli import main
from xlaopt.layout import Layout, LayoutError, load_layout, save_layout
from xlaopt.mesh import MeshSpec
from xlaopt.sharding import DEFAULT_RULES

from conftest import needs_devices

# The default table without the FSDP rule: parameters stay whole on every fsdp device.
NO_PARAM_SHARDING = [[logical, list(axes)] for logical, axes in DEFAULT_RULES if logical != "embed"]


def test_toml_layout_reads_mesh_and_ordered_rules(tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text('mesh = { fsdp = 4, tensor = 2 }\nrules = [\n  ["batch", ["fsdp"]],\n  ["embed", ["fsdp"]],\n'
                    '  ["heads", ["tensor"]],\n]\n')
    layout = load_layout(path)
    assert layout.mesh == MeshSpec.parse("fsdp=4,tensor=2")
    assert layout.rules == (("batch", ("fsdp",)), ("embed", ("fsdp",)), ("heads", ("tensor",)))
    save_layout(layout, tmp_path / "again.json")
    assert load_layout(tmp_path / "again.json") == layout


def test_rules_default_to_the_table(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps({"mesh": {"data": 2}}))
    assert load_layout(tmp_path / "l.json") == Layout(MeshSpec.parse("data=2"), DEFAULT_RULES)


@pytest.mark.parametrize("data, message", [
    ({"rules": []}, "missing field 'mesh'"),
    ({"mesh": {"data": 2}, "rule": []}, "unknown keys ['rule']"),
    ({"mesh": {"data": "2"}}, "mesh sizes must be integers: data='2'"),
    ({"mesh": {"pipe": 2}}, "unknown axis 'pipe'"),
    ({"mesh": {"data": 2}, "rules": [["embed", "fsdp"]]}, "rules[0] = ['embed', 'fsdp']"),
    ({"mesh": {"data": 2}, "rules": [["embed", ["fdsp"]]]}, "unknown mesh axes ['fdsp']"),
])
def test_bad_layout_names_the_field(tmp_path, data, message):
    (tmp_path / "l.json").write_text(json.dumps(data))
    with pytest.raises(LayoutError) as e:
        load_layout(tmp_path / "l.json")
    assert message in str(e.value) and str(tmp_path / "l.json") in str(e.value)


def test_unreadable_or_missing_file(tmp_path):
    (tmp_path / "l.toml").write_text("mesh = {")
    with pytest.raises(LayoutError, match="not TOML"):
        load_layout(tmp_path / "l.toml")
    with pytest.raises(LayoutError, match="does not exist"):
        load_layout(tmp_path / "nope.toml")


def test_mesh_and_layout_together_are_refused(tmp_path, capsys):
    (tmp_path / "l.json").write_text(json.dumps({"mesh": {"fsdp": 2}}))
    assert main(["analyze", "--model", "cosmos3-tiny", "--topology", "h100:1x8", "--mesh", "fsdp=2",
                 "--layout", str(tmp_path / "l.json")]) == 2
    assert "--mesh and --layout both given" in capsys.readouterr().err


@needs_devices(2)
def test_analyze_prices_the_layout_file(tmp_path, capsys):
    """The same mesh priced with the default rules and with a layout that keeps parameters
    whole: the file's rules, not the defaults, decide memory and communication."""
    common = ["analyze", "--model", "cosmos3-tiny", "--set", "num_layers=2", "--topology", "h100:1x8",
              "--batch-size", "2", "--text-len", "32", "--gen-len", "64"]
    (tmp_path / "fsdp.json").write_text(json.dumps({"mesh": {"fsdp": 2}}))
    (tmp_path / "replicated.json").write_text(json.dumps({"mesh": {"fsdp": 2}, "rules": NO_PARAM_SHARDING}))
    results = {}
    for name in ("fsdp", "replicated"):
        assert main(common + ["--layout", str(tmp_path / f"{name}.json"), "--json", str(tmp_path / f"{name}.out")]) == 0
        results[name] = json.loads((tmp_path / f"{name}.out").read_text())
    fsdp, replicated = results["fsdp"], results["replicated"]
    # Whole parameters and optimizer state on each device: about twice the argument bytes.
    ratio = replicated["memory_per_device_bytes"]["arguments"] / fsdp["memory_per_device_bytes"]["arguments"]
    assert 1.8 < ratio <= 2.0, ratio
    # Without FSDP nothing is gathered; the gradient is all-reduced over the batch split instead.
    kinds = lambda r: {c["kind"] for c in r["collectives"]}
    assert "all-gather" in kinds(fsdp) and "all-gather" not in kinds(replicated) and "all-reduce" in kinds(replicated)

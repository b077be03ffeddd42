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
    common = ["analyze", "--model", "llama-tiny", "--set", "num_layers=2", "--topology", "h100:1x8",
              "--batch-size", "2", "--text-len", "32"]
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


HSDP_ORDERED = {"model": "llama-tiny", "topology": "h100:2x4", "mesh": {"data": 2, "fsdp": 4},
                "order": ["data", "fsdp", "context", "tensor"],
                "batch": {"batch_size": 8, "text_len": 32, "gen_len": 0},
                "execution": {"remat": "full", "compute_dtype": "float32"}}


def test_layout_file_holds_order_batch_execution_and_round_trips_as_toml(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps(HSDP_ORDERED))
    layout = load_layout(tmp_path / "l.json")
    # An order written before pipeline stages existed: its stage axis (size 1) goes outermost.
    assert layout.mesh.order == ("stage", "data", "fsdp", "context", "tensor")
    assert (layout.batch.batch_size, layout.batch.text_len, layout.execution.remat) == (8, 32, "full")
    assert (layout.model, layout.topology) == ("llama-tiny", "h100:2x4")
    save_layout(layout, tmp_path / "l.toml")
    assert load_layout(tmp_path / "l.toml") == layout


def test_order_places_the_inner_axes_inside_a_node():
    """Devices are numbered node-major; the innermost axis of the order varies fastest."""
    spec = MeshSpec.parse("data=2,fsdp=4")
    assert spec.placement() == tuple(range(8))  # the default order: fsdp inner
    swapped = spec.with_order(("fsdp", "data", "tensor", "context"))
    # Logical (data d, fsdp f) -> device 2 f + d: an fsdp group strides over both 4-device nodes.
    assert swapped.placement() == (0, 2, 4, 6, 1, 3, 5, 7)
    assert swapped != spec and "devices ordered fsdp>data" in str(swapped)


@pytest.mark.parametrize("change, message", [
    ({"order": ["data", "fsdp"]}, "must name each of stage, data, fsdp, tensor, context once"),
    ({"batch": {"rows": 8}}, "batch has unknown fields ['rows']"),
    ({"batch": {"batch_size": "8"}}, "batch.batch_size = '8' must be int"),
    ({"execution": {"remat": "sometimes"}}, "execution setting remat='sometimes'"),
    ({"model": 3}, "model = 3 must be a string"),
])
def test_bad_layout_extras_name_the_field(tmp_path, change, message):
    (tmp_path / "l.json").write_text(json.dumps(dict(HSDP_ORDERED, **change)))
    with pytest.raises(LayoutError) as e:
        load_layout(tmp_path / "l.json")
    assert message in str(e.value)


def test_layout_for_another_model_or_topology_is_one_line(tmp_path, capsys):
    (tmp_path / "l.json").write_text(json.dumps(HSDP_ORDERED))
    assert main(["analyze", "--model", "cosmos3-tiny", "--topology", "h100:2x4", "--layout",
                 str(tmp_path / "l.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "planned for model llama-tiny, not cosmos3-tiny" in err and len(err.splitlines()) == 1
    assert main(["analyze", "--model", "llama-tiny", "--topology", "h100:4x2", "--layout",
                 str(tmp_path / "l.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "planned for topology h100:2x4, not h100:4x2" in err and "xlaopt plan --from" in err


@needs_devices(8)
def test_hsdp_two_level_mesh_priced_by_where_the_order_puts_each_axis(tmp_path):
    """HSDP on 2 "nodes" of 4: the shard axis (fsdp) inside a node puts the parameter gathers and
    gradient reduce-scatters on NVLink and only the replica all-reduce on the network; the
    swapped order sends the shard traffic over the network instead. Same program, same bytes."""
    results = {}
    for name, order in (("inner", HSDP_ORDERED["order"]), ("outer", ["fsdp", "data", "context", "tensor"])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(dict(HSDP_ORDERED, order=order)))
        assert main(["analyze", "--model", "llama-tiny", "--topology", "h100:2x4", "--layout", str(path),
                     "--json", str(tmp_path / f"{name}.out")]) == 0
        results[name] = json.loads((tmp_path / f"{name}.out").read_text())
    links = lambda r: {(c["mesh_axes"], c["link_level"]) for c in r["collectives"] if c["mesh_axes"] != "-"}
    assert {level for axes, level in links(results["inner"]) if axes == "fsdp"} == {"nvlink4"}
    assert {level for axes, level in links(results["inner"]) if axes == "data"} == {"ib-400g"}
    assert {level for axes, level in links(results["outer"]) if axes == "fsdp"} == {"ib-400g"}
    assert {level for axes, level in links(results["outer"]) if axes == "data"} == {"nvlink4"}
    by_axis = lambda r: {a: c["bytes"] for a, c in r["comm_by_axis"].items()}
    assert by_axis(results["inner"]) == by_axis(results["outer"])
    assert results["inner"]["step_time_s"] < results["outer"]["step_time_s"]


@needs_devices(8)
def test_verify_an_hsdp_layout_with_swapped_device_order(tmp_path, capsys):
    """Which device holds which shard does not change what is computed."""
    path = tmp_path / "l.json"
    path.write_text(json.dumps(dict(HSDP_ORDERED, order=["fsdp", "data", "context", "tensor"])))
    assert main(["verify", "--model", "llama-tiny", "--layout", str(path)]) == 0
    assert "(devices ordered fsdp>data)" in capsys.readouterr().out


@needs_devices(8)
def test_an_fp16_hsdp_layout_verifies_against_fp32_and_trains(tmp_path, capsys):
    """The layout file's execution reaches the step: fp16 with loss scaling, checked against an
    fp32 single-device reference, then trained."""
    path = tmp_path / "fp16.json"
    path.write_text(json.dumps(dict(HSDP_ORDERED, execution={"compute_dtype": "float16"})))
    assert main(["verify", "--model", "llama-tiny", "--layout", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(float16" in out and "ok" in out
    assert main(["train", "--model", "llama-tiny", "--layout", str(path), "--steps", "2", "--no-progress",
                 "--json", str(tmp_path / "t.json")]) == 0
    steps = json.loads((tmp_path / "t.json").read_text())["steps"]
    assert len(steps) == 2 and all("loss_scale" in s for s in steps)

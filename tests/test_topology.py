import json

import pytest

from xlaopt.analysis.topology import TopologyError, parse_topology


def test_presets_from_the_command_line_spelling():
    t = parse_topology("h100:16x8")
    assert (t.nodes, t.devices_per_node, t.num_devices) == (16, 8, 128)
    assert [l.name for l in t.levels] == ["nvlink4", "ib-400g"]
    assert t.levels[1].bytes_per_s == 50e9  # 400 Gb/s per GPU
    assert t.device.peak_flops["bfloat16"] == 989e12
    assert parse_topology("a100:2x8").levels[1].bytes_per_s == 25e9
    assert parse_topology("gb200").num_devices == 72
    assert parse_topology("h200:4x8").device.hbm_bytes == 141e9


def test_link_level_of_a_group():
    t = parse_topology("h100:2x8")
    assert t.level_of([0, 3, 7]).name == "nvlink4"
    assert t.level_of([7, 8]).name == "ib-400g"


@pytest.mark.parametrize("spec, message", [
    ("h800:2x8", "unknown topology preset 'h800'"),
    ("gb200:1x144", "at most 72 GPUs"),
    ("no/such/file.toml", "neither PRESET:NODESxDEVICES"),
])
def test_bad_topologies_say_why(spec, message):
    with pytest.raises(TopologyError, match=message):
        parse_topology(spec)


def _custom():
    return {"name": "lab", "nodes": 2, "devices_per_node": 4,
            "device": {"name": "X", "peak_flops": {"bfloat16": 1e15}, "hbm_bytes": 96e9, "hbm_bytes_per_s": 4e12},
            "levels": [{"name": "nvl", "bytes_per_s": 4e11, "latency_s": 2e-6},
                       {"name": "roce", "bytes_per_s": 2.5e10, "latency_s": 1.5e-5}]}


def test_custom_topology_files(tmp_path):
    js = tmp_path / "lab.json"
    js.write_text(json.dumps(_custom()))
    toml = tmp_path / "lab.toml"
    toml.write_text('name = "lab"\nnodes = 2\ndevices_per_node = 4\n'
                    '[device]\nname = "X"\nhbm_bytes = 96e9\nhbm_bytes_per_s = 4e12\n[device.peak_flops]\nbfloat16 = 1e15\n'
                    '[[levels]]\nname = "nvl"\nbytes_per_s = 4e11\nlatency_s = 2e-6\n'
                    '[[levels]]\nname = "roce"\nbytes_per_s = 2.5e10\nlatency_s = 1.5e-5\n')
    assert parse_topology(str(js)) == parse_topology(str(toml))
    assert parse_topology(str(js)).level_of([3, 4]).name == "roce"


def test_missing_field_is_named(tmp_path):
    data = _custom()
    del data["levels"][1]["latency_s"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TopologyError, match=r"missing field levels\[1\].latency_s"):
        parse_topology(str(path))


def test_gpu_device_kinds_find_their_datasheet_peak():
    from xlaopt.analysis.topology import device_for_kind

    assert device_for_kind("NVIDIA H100 80GB HBM3").peak_flops["bfloat16"] == 989e12
    assert device_for_kind("NVIDIA A100-SXM4-80GB").name == "A100 SXM 80GB"
    assert device_for_kind("cpu") is None


def test_cpu_simulation_prices_every_compute_dtype():
    """analyze prices a CPU compile's matmuls at the compute dtype's peak: each has the measured one."""
    from xlaopt.analysis.topology import cpu_simulation
    from xlaopt.execution import DTYPES

    device = cpu_simulation(4, host_flops=8e9).device
    assert {dtype: device.peak_flops[dtype] for dtype in DTYPES} == {dtype: 2e9 for dtype in DTYPES}

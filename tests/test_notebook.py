"""The notebook view of a compiled step (`xlaopt.analysis.notebook`) and `experiments/inspect_cosmos3.ipynb`.

The HTML tables and SVG timeline are checked on a hand-built schedule with hand-computed times
(escaping, lanes, totals, binning of short ops, JSON round trip). The notebook is executed the way
Jupyter would, without Jupyter: its code cells run in order in one namespace in a fresh Python
process (this file run as a script), each cell's last expression "displayed" through
`_repr_html_` as a notebook front end does. The fresh process matters: the notebook must request
its own simulated devices before JAX starts. One compile of the tiny step, ~40-80 s on 2 cores.
"""
import ast
import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import traceback

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "inspect_cosmos3.ipynb"


# --- the runner (this file as a script) -----------------------------------------------------
def run_notebook(path: pathlib.Path, exports: list[str]) -> dict:
    """Run the code cells of the .ipynb at `path` in order in one namespace. Returns
    {"cells": [{index, stdout, html, text}], "error": traceback or None, "exports": {name: json}}."""
    nb = json.loads(path.read_text())
    namespace = {"__name__": "__main__"}
    out = {"cells": [], "error": None, "exports": {}}
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        record = {"index": index, "stdout": "", "html": None, "text": None}
        out["cells"].append(record)
        buffer = io.StringIO()
        try:
            if re.search(r"^\s*[%!]", source, re.M):
                raise SyntaxError(f"cell {index}: IPython magics and shell escapes are not supported here")
            tree = ast.parse(source, f"<cell {index}>")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            with contextlib.redirect_stdout(buffer):
                exec(compile(tree, f"<cell {index}>", "exec"), namespace)
                value = (eval(compile(ast.Expression(last.value), f"<cell {index}>", "eval"), namespace)
                         if last is not None else None)
            if value is not None:
                record["html"] = value._repr_html_() if hasattr(value, "_repr_html_") else None
                record["text"] = repr(value)
        except BaseException:  # noqa: BLE001 (reported to the test, which fails naming the cell)
            out["error"] = f"cell {index}:\n{traceback.format_exc()}"
            break
        finally:
            record["stdout"] = buffer.getvalue()
    if out["error"] is None:
        out["exports"] = {name: namespace[name].to_json() for name in exports}
    return out


if __name__ == "__main__":
    notebook, result_path, *names = sys.argv[1:]
    result = run_notebook(pathlib.Path(notebook), names)
    pathlib.Path(result_path).write_text(json.dumps(result))
    sys.exit(1 if result["error"] else 0)


# --- unit tests on hand-made data -----------------------------------------------------------
from test_simulate import EFF, MESH, TOPO, compute, done, gather  # noqa: E402

from xlaopt.analysis.notebook import Analysis, Table, esc, fmt_seconds, timeline_svg  # noqa: E402
from xlaopt.analysis.schedule import Schedule  # noqa: E402
from xlaopt.analysis.simulate import bounds, simulate  # noqa: E402

HOSTILE = '<img src=x onerror="alert(1)">&'


def small_sim():
    """1 ms compute, a 1 ms synchronous gather over fsdp (exposed), 1 ms compute under a 0.5 ms
    async gather over data (hidden; 0.05 ms at the fast link's rate is 0.5 ms across nodes), then 40 ops of 100 ns: step 3.004 ms."""
    ops = ([compute(HOSTILE, 1), gather("gather.sync", 1),
            gather("gather.async", 0.05, "collective-start", group=(0, 2)), compute("b", 1), done("gd", "gather.async")]
           + [compute(f"tiny.{i}", 1e-4) for i in range(40)])
    return simulate(Schedule(ops, "main", [], {"main": ops}), TOPO, MESH, eff=EFF)


def small_analysis() -> Analysis:
    sim = small_sim()
    result = {
        "model": "toy<model>", "mesh": MESH, "devices": 4, "topology": TOPO.name, "device": TOPO.device.name,
        "target": "cpu", "batch": {"batch_size": 2, "text_len": 4, "gen_len": 8}, "compute_dtype": "bfloat16",
        "step_time_s": sim.step_time_s, "mfu": 0.5, "exposed_comm_s": sim.exposed_comm_s,
        "exposed_comm_by_axis_s": sim.exposed_by_axis, "comm_by_axis": sim.comm_by_axis,
        "compute_s": sim.compute_s, "comm_s": sim.comm_s, "compute_idle_fraction": sim.compute_idle_fraction,
        "comm_idle_fraction": sim.comm_idle_fraction, "bounds": bounds(sim), "model_flops_per_step": 1e9,
        "memory_per_device_bytes": {"arguments": 3 * 2**20, "outputs": 2**20, "aliased": 2**20, "temp": 2**19,
                                    "peak_estimate": 3 * 2**20 + 2**19},
        "hbm_bytes": 2**30, "fits_hbm": True, "collectives": sim.collectives,
        "data": "hand-made rows", "fill": 0.9, "attention": {"impl": "segment"},
        "attention_pairs_executed_over_needed": 1.25, "hlo_flops_over_model_flops": 1.1,
        "notes": [f"note with {HOSTILE}"],
    }
    return Analysis.from_result(result, sim)


def test_small_schedule_times():
    sim = small_sim()
    assert sim.step_time_s == pytest.approx(3.004e-3)
    assert sim.exposed_by_axis == {"fsdp": pytest.approx(1e-3), "data": pytest.approx(0.0)}


def test_timeline_has_three_lanes_with_totals_and_bins_short_ops():
    a = small_analysis()
    svg = a.timeline_view().html
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    lanes = dict(re.findall(r'<text class="lane" data-stream="(\w+)"[^>]*>([^<]*)</text>', svg))
    assert lanes == {"compute": "compute 2 ms", "wait": "blocked on comm 1 ms", "comm": "communication 1.5 ms"}
    # 1 ms of 3.004 ms over 760 px: the long ops are their own rectangles...
    assert len(re.findall(r'class="ev compute"', svg)) == 2
    assert len(re.findall(r'class="ev comm"', svg)) == 2 and len(re.findall(r'class="ev wait"', svg)) == 1
    # ...the forty 100 ns ops (0.025 px each) are summed per pixel column
    bins = re.findall(r'class="bin compute"[^>]*><title>(\d+) short ops', svg)
    assert bins and sum(map(int, bins)) >= 40
    # communication coloured per mesh axes, and the legend names them
    assert "communication over fsdp" in svg and "communication over data" in svg
    # escaped, never raw
    assert HOSTILE not in svg and esc(HOSTILE) in svg


def test_timeline_of_nothing_is_still_an_svg():
    svg = timeline_svg([], 0.0)
    assert svg.startswith("<svg") and "compute 0" in svg


def test_tables_hold_the_numbers():
    a = small_analysis()
    axes = {row[0]: row for row in a.axis_table().rows}
    assert set(axes) == {"fsdp", "data"}
    assert axes["fsdp"][2] == pytest.approx(1e-3) and axes["fsdp"][3] == pytest.approx(1e-3)
    assert axes["data"][2] == pytest.approx(0.5e-3) and axes["data"][3] == pytest.approx(0.0)
    coll = {row[0]: row for row in a.collectives_table().rows}
    assert set(coll) == {"all-gather", "all-gather (async)"}
    assert coll["all-gather"][1:3] == ("fsdp", "fast") and coll["all-gather (async)"][1:3] == ("data", "slow")
    assert coll["all-gather"][5] == 2 * 1e-3 * 100e9  # bytes per step: one run of the 200 MB gather
    mem = {row[0]: row[1] for row in a.memory_table().rows}
    assert mem["peak estimate"] == 3 * 2**20 + 2**19 and mem["HBM"] == 2**30
    top = a.top_ops(3).rows
    assert len(top) == 3
    assert {r[0] for r in top} == {HOSTILE, "b", "gather.sync"}
    assert top[0][5] == pytest.approx(1e-3) and top[0][6] == pytest.approx(1e-3 / 3.004e-3)
    summary = {r[0]: r[1] for r in a.summary_table().rows}
    assert summary["step time"] == fmt_seconds(3.004e-3) == "3 ms"
    assert summary["fill (real tokens / slots)"] == "90.0%"
    assert summary["attention (segment): pairs executed / needed"] == "1.25x"
    assert summary["HLO matmul FLOPs / model FLOPs"] == "1.1x"


def test_html_escapes_every_string_and_holds_every_section():
    a = small_analysis()
    page = a._repr_html_()
    assert HOSTILE not in page and "toy<model>" not in page
    assert "toy&lt;model&gt;" in page and page.count(esc(HOSTILE)) >= 3  # top ops, tooltip, note
    for caption in ("summary", "communication by mesh axes (per step)", "collectives by kind, mesh axes and link level",
                    "memory per device", "top "):
        assert f"<caption>{caption}" in page
    assert page.count("<svg") == 1 and page.count("<table>") == 5
    t = Table("a&b", ("x<y",), ("text",), (("<td>",),), note='"quoted"')
    assert t._repr_html_().count("&lt;td&gt;") == 1 and "a&amp;b" in t.html() and "&quot;quoted&quot;" in t.html()
    with pytest.raises(ValueError, match="one value per column"):
        Table("bad", ("a", "b"), ("text", "text"), ((1,),))


def test_json_round_trip():
    a = small_analysis()
    text = a.to_json()
    back = Analysis.from_json(text)
    assert back == a and back.to_json() == text
    assert json.loads(text)["analysis"]["step_time_s"] == a.result["step_time_s"]
    assert {e["stream"] for e in json.loads(text)["timeline"]} == {"compute", "comm", "wait"}


# --- the notebook, executed -----------------------------------------------------------------
def test_notebook_is_clean_nbformat4():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)  # no stored outputs
    assert any(c["cell_type"] == "markdown" for c in nb["cells"])


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    out = tmp_path_factory.mktemp("notebook") / "result.json"
    env = dict(os.environ)
    # conftest gave this process 8 devices through XLA_FLAGS; the notebook must ask for its own
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    proc = subprocess.run([sys.executable, __file__, str(NOTEBOOK), str(out), "view"], env=env,
                          cwd=NOTEBOOK.parent, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["error"] is None, result["error"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result


@pytest.mark.slow  # executes the notebook in a fresh process: compiles and analyses a step
def test_notebook_runs_and_shows_tables_timeline_and_json(executed):
    cells = executed["cells"]
    nb = json.loads(NOTEBOOK.read_text())
    assert len(cells) == sum(c["cell_type"] == "code" for c in nb["cells"])  # every code cell ran
    assert cells[0]["text"].count("CpuDevice") == 8  # the notebook's own 8 simulated devices
    assert "mesh-layout" in cells[1]["text"]
    htmls = [c["html"] or "" for c in cells]
    captions = [re.findall(r"<caption>([^<]*)</caption>", h) for h in htmls]
    assert ["summary"] in captions and ["memory per device"] in captions
    assert ["collectives by kind, mesh axes and link level"] in captions
    assert any(c and c[0].startswith("top 12 ops") for c in captions)
    # the view of everything: five tables and the timeline with its three lanes
    page = next(h for h in htmls if h.count("<table>") == 5)
    assert page.count("<svg") == 1
    assert set(re.findall(r'<text class="lane" data-stream="(\w+)"', page)) == {"compute", "wait", "comm"}
    assert "fsdp" in page and "tensor" in page and "nvlink4" in page
    assert any(h.startswith("<svg") for h in htmls)  # the timeline on its own
    assert "characters of JSON" in cells[-1]["stdout"]

    from xlaopt.analysis.notebook import Analysis

    view = Analysis.from_json(executed["exports"]["view"])
    r = view.result
    assert r["model"] == "cosmos3-tiny" and r["topology"] == "h100:1x8" and r["target"] == "cpu"
    # The embedding lookups' backward moves ids and rows to the tables' shards: collective-permutes
    # over both axes.
    assert set(r["comm_by_axis"]) == {"fsdp", "tensor", "fsdp,tensor"}
    assert r["comm_s"] > 0 and r["exposed_comm_s"] == pytest.approx(r["comm_s"], rel=1e-9)  # the CPU schedule hides nothing
    assert sum(e.dur_s for e in view.timeline if e.stream == "wait") == pytest.approx(r["exposed_comm_s"], rel=1e-9)
    assert 0 < r["mfu"] < 1 and r["memory_per_device_bytes"]["peak_estimate"] > 0
    assert Analysis.from_json(view.to_json()) == view

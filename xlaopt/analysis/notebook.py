"""The compiled step in a notebook: one call compiles, simulates and returns a view that Jupyter
renders as HTML tables and an SVG timeline, and that stays plain data (JSON in, JSON out).

    from xlaopt.analysis.notebook import show
    view = show(program, "h100:1x8")   # an Analysis; the last line of a cell renders it
    view.collectives_table()           # any one table on its own
    view.to_json()                     # the same data: analyze's JSON plus the timeline events

Nothing here imports IPython or matplotlib: objects render through `_repr_html_`, which
Jupyter calls, and the timeline is SVG written here. Every string put into HTML is escaped.

An `Analysis` holds `result` (the dict `xlaopt.analysis.analyze.analyze` returns, JSON-normalised) and
`timeline` (the simulated `Event`s: the compute stream, compute blocked on communication, and
the communication stream). The tables are computed from those two on demand.
"""
from __future__ import annotations

import collections
import dataclasses
import html
import json
import math
from typing import Any, Sequence

from xlaopt.analysis.simulate import Event

# Lanes top to bottom: (stream, label). "wait" is the compute stream blocked on a collective.
LANES = (("compute", "compute"), ("wait", "blocked on comm"), ("comm", "communication"))
COMPUTE_COLOR, WAIT_COLOR = "#4c78a8", "#e45756"
AXIS_COLORS = ("#f58518", "#54a24b", "#b279a2", "#eeca3b", "#72b7b2", "#9d755d", "#ff9da6", "#bab0ac")
_STYLE = (".xlaopt-view{font-family:system-ui,sans-serif;font-size:13px}"
          ".xlaopt-view table{border-collapse:collapse;margin:4px 0 12px 0}"
          ".xlaopt-view caption{text-align:left;font-weight:600;padding:2px 0}"
          ".xlaopt-view th,.xlaopt-view td{border:1px solid #ccc;padding:2px 8px}"
          ".xlaopt-view td.num{text-align:right;font-variant-numeric:tabular-nums}"
          ".xlaopt-view .note{color:#555;margin:2px 0}")


def esc(value: Any) -> str:
    """Text safe inside HTML/SVG elements and quoted attributes."""
    return html.escape(str(value), quote=True)


# --- number formats -----------------------------------------------------------------------
def fmt_seconds(s: float) -> str:
    a = abs(s)
    if a == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= scale:
            return f"{s / scale:,.3g} {unit}" if a < 1000 * scale else f"{s / scale:,.0f} {unit}"
    return f"{s / 1e-9:,.3g} ns"


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{int(b):,} B"


def fmt_count(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.3g} {unit}"
    return f"{x:,.3g}" if isinstance(x, float) else f"{x:,}"


def fmt_percent(x: float) -> str:
    """Three significant figures, so a tiny MFU or share of HBM does not read as 0.0%."""
    return "0%" if x == 0 else f"{x * 100:.1f}%" if abs(x) >= 0.1 else f"{x * 100:.3g}%"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}x"


FORMATS = {"text": str, "int": lambda x: f"{x:,}", "seconds": fmt_seconds, "bytes": fmt_bytes,
           "percent": fmt_percent, "count": fmt_count}


@dataclasses.dataclass(frozen=True)
class Table:
    """A titled table of raw values; `formats` names how each column is shown (see FORMATS)."""
    title: str
    columns: tuple[str, ...]
    formats: tuple[str, ...]
    rows: tuple[tuple, ...]
    note: str = ""

    def __post_init__(self):
        if len(self.columns) != len(self.formats) or any(len(r) != len(self.columns) for r in self.rows):
            raise ValueError(f"table {self.title!r}: every row needs one value per column {self.columns}")
        unknown = set(self.formats) - set(FORMATS)
        if unknown:
            raise ValueError(f"table {self.title!r}: unknown formats {sorted(unknown)}; use {sorted(FORMATS)}")

    def to_dict(self) -> dict:
        return {"title": self.title, "columns": list(self.columns),
                "rows": [dict(zip(self.columns, r)) for r in self.rows], "note": self.note}

    def html(self) -> str:
        head = "".join(f"<th>{esc(c)}</th>" for c in self.columns)
        body = []
        for row in self.rows:
            cells = []
            for value, f in zip(row, self.formats):
                if value is None:
                    cells.append('<td class="num">-</td>')
                elif f == "text":
                    cells.append(f"<td>{esc(value)}</td>")
                else:
                    cells.append(f'<td class="num" title="{esc(value)}">{esc(FORMATS[f](value))}</td>')
            body.append("<tr>" + "".join(cells) + "</tr>")
        note = f'<div class="note">{esc(self.note)}</div>' if self.note else ""
        return (f'<table><caption>{esc(self.title)}</caption><thead><tr>{head}</tr></thead>'
                f'<tbody>{"".join(body)}</tbody></table>{note}')

    def _repr_html_(self) -> str:
        return f'<div class="xlaopt-view"><style>{_STYLE}</style>{self.html()}</div>'


@dataclasses.dataclass(frozen=True)
class Html:
    """A fragment of HTML (the timeline's SVG) that Jupyter renders."""
    html: str

    def _repr_html_(self) -> str:
        return self.html


# --- the timeline ---------------------------------------------------------------------------
def axis_colors(events: Sequence[Event]) -> dict[str, str]:
    axes = sorted({e.axes or "-" for e in events if e.stream == "comm"})
    return {a: AXIS_COLORS[i % len(AXIS_COLORS)] for i, a in enumerate(axes)}


def _nice_step(span: float, ticks: int = 6) -> float:
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def timeline_svg(events: Sequence[Event], step_time_s: float | None = None, width: int = 960,
                 lane_height: int = 22, label_width: int = 190, min_px: float = 1.0) -> str:
    """Inline SVG: one lane per stream (compute, compute blocked on communication, communication),
    time left to right. An event at least `min_px` wide is its own rectangle with a tooltip; shorter
    ones are summed per pixel column and drawn as one rectangle whose opacity is how busy the
    column is, so thousands of sub-microsecond ops stay readable and the SVG stays small. Each
    lane's label carries its total time; communication is coloured by mesh axes."""
    end = max([step_time_s or 0.0] + [e.start_s + e.dur_s for e in events])
    span = end if end > 0 else 1.0
    plot_w = width - label_width - 10
    px_per_s = plot_w / span
    colors = axis_colors(events)
    color_of = lambda e: (COMPUTE_COLOR if e.stream == "compute" else WAIT_COLOR if e.stream == "wait"
                          else colors[e.axes or "-"])
    lane_y = {stream: 8 + i * (lane_height + 8) for i, (stream, _) in enumerate(LANES)}
    totals = collections.Counter()
    counts = collections.Counter()
    parts: list[str] = []
    bins: dict[tuple, float] = collections.defaultdict(float)  # (stream, color, column) -> busy s
    bin_n: dict[tuple, int] = collections.Counter()
    for e in events:
        if e.stream not in lane_y:
            continue
        totals[e.stream] += e.dur_s
        counts[e.stream] += 1
        w = e.dur_s * px_per_s
        if w >= min_px:
            x = label_width + e.start_s * px_per_s
            tip = (f"{e.name} ({e.kind}{', ' + e.axes if e.axes else ''}): {fmt_seconds(e.dur_s)} at "
                   f"{fmt_seconds(e.start_s)}" + (f", {fmt_bytes(e.bytes)}" if e.bytes else "")
                   + (f", {fmt_count(e.flops)}FLOP" if e.flops else ""))
            parts.append(f'<rect class="ev {esc(e.stream)}" x="{x:.2f}" y="{lane_y[e.stream]}" width="{w:.2f}" '
                         f'height="{lane_height}" fill="{esc(color_of(e))}"><title>{esc(tip)}</title></rect>')
        else:  # spread a sub-pixel event over the (at most two) columns it touches
            start, stop = e.start_s, e.start_s + e.dur_s
            first = min(int(start * px_per_s), plot_w - 1)
            last = min(int(stop * px_per_s), plot_w - 1)
            for col in range(first, last + 1):
                piece = min(stop, (col + 1) / px_per_s) - max(start, col / px_per_s)
                if piece > 0 or col == first:
                    key = (e.stream, color_of(e), col)
                    bins[key] += max(piece, 0.0)
                    bin_n[key] += 1
    col_s = 1 / px_per_s
    for (stream, color, col), busy in sorted(bins.items()):
        if busy <= 0:
            continue
        opacity = min(1.0, busy / col_s)
        tip = f"{bin_n[stream, color, col]} short ops, {fmt_seconds(busy)} busy at {fmt_seconds(col * col_s)}"
        parts.append(f'<rect class="bin {esc(stream)}" x="{label_width + col}" y="{lane_y[stream]}" width="1" '
                     f'height="{lane_height}" fill="{esc(color)}" fill-opacity="{max(opacity, 0.15):.2f}">'
                     f'<title>{esc(tip)}</title></rect>')
    axis_y = 8 + len(LANES) * (lane_height + 8)
    labels = []
    for stream, label in LANES:
        y = lane_y[stream] + lane_height * 0.7
        labels.append(f'<text class="lane" data-stream="{esc(stream)}" x="4" y="{y:.1f}">{esc(label)} '
                      f'{esc(fmt_seconds(totals[stream]))}</text>')
        labels.append(f'<rect x="{label_width}" y="{lane_y[stream]}" width="{plot_w}" height="{lane_height}" '
                      f'fill="#f4f4f4"/>')
    ticks, items, height = _axis_and_legend(span, px_per_s, label_width, plot_w, axis_y, colors)
    title = (f"simulated step: {fmt_seconds(end)}; " + ", ".join(
        f"{label} {fmt_seconds(totals[s])} ({counts[s]} events)" for s, label in LANES))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="xlaopt-timeline" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="system-ui,sans-serif" font-size="11">'
            f'<title>{esc(title)}</title>{"".join(labels)}{"".join(parts)}{"".join(ticks)}{"".join(items)}</svg>')


def _axis_and_legend(span: float, px_per_s: float, label_width: int, plot_w: int, axis_y: int,
                     colors: dict[str, str]) -> tuple[list[str], list[str], int]:
    """The time axis under the lanes, the colour legend under it, and the SVG's height."""
    step = _nice_step(span)
    ticks = [f'<line x1="{label_width}" y1="{axis_y}" x2="{label_width + plot_w}" y2="{axis_y}" stroke="#888"/>']
    for i in range(int(span / step) + 1):
        t = i * step
        x = label_width + t * px_per_s
        ticks.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#888"/>'
                     f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{esc(fmt_seconds(t))}</text>')
    legend = [("compute", COMPUTE_COLOR), ("compute blocked on communication", WAIT_COLOR)]
    legend += [(f"communication over {a}", c) for a, c in colors.items()]
    legend_y = axis_y + 34
    items, x = [], label_width
    for text, color in legend:
        items.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{esc(color)}"/>'
                     f'<text x="{x + 16}" y="{legend_y}">{esc(text)}</text>')
        x += 24 + 7 * len(text)
    return ticks, items, legend_y + 10


# --- the analysis -------------------------------------------------------------------------
def _plain(value):
    """JSON's view of `value` (tuples become lists, keys strings): what a round trip gives back."""
    return json.loads(json.dumps(value))


@dataclasses.dataclass(frozen=True, repr=False)
class Analysis:
    """`xlaopt.analysis.analyze`'s result for one compiled step and its simulated timeline; renders in
    Jupyter (`_repr_html_`), round-trips through JSON (`to_json` / `from_json`)."""
    result: dict
    timeline: tuple[Event, ...] = ()

    def __repr__(self) -> str:  # the data runs to megabytes; say what it is
        r = self.result
        mesh = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "single-device"
        return (f"Analysis({r['model']} on {mesh}, {r['topology']}, target {r['target']}: step "
                f"{fmt_seconds(r['step_time_s'])}, {len(self.timeline)} timeline events)")

    @classmethod
    def from_result(cls, result: dict, timeline=()) -> "Analysis":
        """`timeline`: a `SimResult` or its events."""
        events = getattr(timeline, "timeline", timeline)
        return cls(_plain(result), tuple(events))

    # plain data
    def to_dict(self) -> dict:
        return {"analysis": self.result, "timeline": [dataclasses.asdict(e) for e in self.timeline]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Analysis":
        return cls(_plain(data["analysis"]), tuple(Event(**e) for e in data.get("timeline", ())))

    @classmethod
    def from_json(cls, text: str) -> "Analysis":
        return cls.from_dict(json.loads(text))

    # tables
    def summary_table(self) -> Table:
        r = self.result
        mesh = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "single-device"
        mem = r["memory_per_device_bytes"]
        b = r.get("batch") or {}
        rows = [
            ("model", r["model"], "text"),
            ("mesh", f"{mesh} ({r['devices']} devices)", "text"),
            ("topology", f"{r['topology']} ({r['device']}), target {r['target']}", "text"),
            ("batch", f"{b.get('batch_size')} x ({b.get('text_len')} text + {b.get('gen_len')} gen) tokens, "
                      f"{r.get('compute_dtype')}", "text"),
            ("step time", r["step_time_s"], "seconds"),
            ("MFU", r["mfu"], "percent"),
            ("compute", r["compute_s"], "seconds"),
            ("communication", r["comm_s"], "seconds"),
            ("exposed communication", r["exposed_comm_s"], "seconds"),
            ("compute stream idle", r["compute_idle_fraction"], "percent"),
            ("communication stream idle", r["comm_idle_fraction"], "percent"),
            ("bound: everything serial", r["bounds"]["serial_s"], "seconds"),
            ("bound: communication perfectly hidden", r["bounds"]["perfect_overlap_s"], "seconds"),
            ("memory per device (peak estimate)", mem["peak_estimate"], "bytes"),
            ("model FLOPs per step", r["model_flops_per_step"], "count"),
            ("data", r["data"], "text"),
            ("fill (real tokens / slots)", r["fill"], "percent"),
            (f"attention ({r['attention']['impl']}): pairs executed / needed",
             _ratio(r["attention_pairs_executed_over_needed"]), "text"),
            ("HLO matmul FLOPs / model FLOPs", _ratio(r["hlo_flops_over_model_flops"]), "text"),
        ]
        return Table("summary", ("quantity", "value"), ("text", "text"),
                     tuple((name, FORMATS[f](v)) for name, v, f in rows))

    def axis_table(self) -> Table:
        rows = sorted(((axes, c["bytes"], c["time_s"], c["exposed_s"])
                       for axes, c in self.result["comm_by_axis"].items()), key=lambda r: -r[2])
        return Table("communication by mesh axes (per step)", ("mesh axes", "bytes", "time", "exposed"),
                     ("text", "bytes", "seconds", "seconds"), tuple(rows))

    def collectives_table(self) -> Table:
        """Collectives grouped by kind, mesh axes and the link level they cross; bytes per step
        are the priced bytes times executions."""
        groups: dict[tuple, list] = {}
        for c in self.result["collectives"]:
            key = (c["kind"] + (" (async)" if c["is_async"] else ""), c["mesh_axes"], c["link_level"])
            g = groups.setdefault(key, [0, 0, 0, 0.0, 0.0])
            g[0] += 1
            g[1] += c["executions"]
            g[2] += c["priced_bytes"] * c["executions"]
            g[3] += c["time_s"]
            g[4] += c["exposed_s"]
        rows = sorted((k + tuple(v) for k, v in groups.items()), key=lambda r: -r[6])
        return Table("collectives by kind, mesh axes and link level",
                     ("kind", "mesh axes", "link", "instructions", "runs/step", "bytes/step", "time", "exposed"),
                     ("text", "text", "text", "int", "int", "bytes", "seconds", "seconds"), tuple(rows))

    def memory_table(self) -> Table:
        r = self.result
        mem = r["memory_per_device_bytes"]
        hbm = r.get("hbm_bytes") or 0
        rows = [(k.replace("_", " "), mem[k], mem[k] / hbm if hbm else None)
                for k in ("arguments", "outputs", "aliased", "temp", "peak_estimate")]
        if hbm:
            rows.append(("HBM", hbm, 1.0))
        note = ("peak estimate = arguments + outputs - aliased + temp"
                + ("" if not hbm else "; fits in HBM" if r.get("fits_hbm", True) else "; DOES NOT FIT in HBM"))
        return Table("memory per device", ("buffer", "bytes", "of HBM"), ("text", "bytes", "percent"),
                     tuple(rows), note)

    def top_ops(self, n: int = 15) -> Table:
        """The `n` instructions with the most simulated time per step (an op inside a loop body
        summed over its trips), compute and collectives alike."""
        ops: dict[tuple, list] = {}
        for e in self.timeline:
            if e.stream == "wait":
                continue
            o = ops.setdefault((e.stream, e.name), [e.kind, e.axes, 0, 0.0, 0.0, 0])
            o[2] += 1
            o[3] += e.dur_s
            o[4] += e.flops
            o[5] += e.bytes
        step = self.result["step_time_s"] or 1.0
        rows = sorted(((name, stream, kind, axes or "", runs, t, t / step, flops, nbytes)
                       for (stream, name), (kind, axes, runs, t, flops, nbytes) in ops.items()),
                      key=lambda r: -r[5])[:n]
        return Table(f"top {len(rows)} ops by simulated time per step",
                     ("op", "stream", "kind", "mesh axes", "runs", "time", "of step", "FLOPs", "bytes"),
                     ("text", "text", "text", "text", "int", "seconds", "percent", "count", "bytes"), tuple(rows))

    def timeline_view(self, width: int = 960) -> Html:
        return Html(timeline_svg(self.timeline, self.result["step_time_s"], width))

    def _repr_html_(self) -> str:
        r = self.result
        head = (f"<h3>{esc(r['model'])} on {esc(r['topology'])} ({esc(r['target'])} schedule): step "
                f"{esc(fmt_seconds(r['step_time_s']))}, MFU {esc(fmt_percent(r['mfu']))}</h3>")
        timeline = (timeline_svg(self.timeline, r["step_time_s"]) if self.timeline
                    else '<div class="note">no timeline kept</div>')
        tables = "".join(t.html() for t in (self.summary_table(), self.axis_table(), self.collectives_table(),
                                            self.memory_table(), self.top_ops()))
        notes = "".join(f'<div class="note">note: {esc(n)}</div>' for n in r.get("notes", ()))
        return f'<div class="xlaopt-view"><style>{_STYLE}</style>{head}{timeline}{tables}{notes}</div>'


def show(program, topology="h100:1x8", target: str | None = None, batch=None) -> Analysis:
    """Compile `program`'s step for `target` (default: the program's own), simulate it on `topology` (a Topology or a spec
    such as "h100:1x8") for `batch` (a `PricedBatch`; default: the synthetic stream's first) and return the
    Analysis; the last line of a notebook cell renders it."""
    from xlaopt.analysis.analyze import analyze_with_sim
    from xlaopt.analysis.topology import parse_topology

    if isinstance(topology, str):
        topology = parse_topology(topology)
    result, sim = analyze_with_sim(program, topology, target, keep_timeline=True, batch=batch)
    return Analysis.from_result(result, sim)

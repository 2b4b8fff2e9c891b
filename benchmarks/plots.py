"""SVG charts of one benchmark run, drawn from the JSON ``bench.py`` writes.

``bench.py`` writes them next to ``latest.json`` at the end of every run; to draw them again
from a saved run::

    python -m benchmarks.plots benchmarks/results/latest.json --out DIR [--table]

(``--table`` also writes ``table.md``, the run's table under three lines on how it ran.)

The rows are ``report.Results.row``'s dicts. Three charts:

- ``throughput-ratios.svg``: every throughput row (msg/s, I/O efficiency) with a baseline, as
  its median paired ratio to that baseline (``report.paired_ratios``), min-max whiskers over
  the repeats, and the target's line where the target is a ratio (an absolute target and its
  result are written beside the row). Higher is better.
- ``cost-ratios.svg``: the same for the cost rows (CPU per message, latencies, RSS). Lower is
  better.
- ``cpu-per-message.svg``: consumer CPU per message (us), by contender, one bar per consume
  case (c=1, c=10, c=100, and the --processes 2 case), median with min-max whiskers.

Hand-written SVG and the standard library only: the same JSON always gives the same bytes, and
no plotting library enters either venv. Bars are linear from 0 (a bar's length is proportional
to its value); colours are Okabe and Ito's colour-blind-safe palette, and every bar is also
named in text.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from .report import docs_table

WIDTH = 800
FONT = "DejaVu Sans, Verdana, Arial, Helvetica, sans-serif"
PLOT_X0 = 20.0  # a bar's zero
PLOT_X1 = 640.0  # the axis maximum; the value text may run on to WIDTH - 10
ROW_H = 34.0  # a label line above each bar
GROUP_H = 28.0
# A ratio axis ends here: one far outlier (Dramatiq's CLI at c=1, 4.7x with a whisker to 8x)
# would otherwise squeeze 0.9x and 1x into a few pixels. A longer bar or whisker is cut at
# the axis's end with an arrow; its text still says the whole value.
RATIO_AXIS_CAP = 2.5

# Okabe & Ito (2008), colour-blind safe; the two raw aio-pika baselines in greys.
CONTENDER_COLOURS = {
    "raw": "#8c8c8c",
    "raw-redis": "#d0d0d0",
    "weclaw": "#0072B2",
    "weclaw-guard": "#56B4E9",
    "weclaw-results": "#56B4E9",
    "weclaw-guard-uvloop": "#009E73",
    "weclaw-guard-p2": "#CC79A7",
    "faststream": "#E69F00",
    "dramatiq": "#D55E00",
    "dramatiq-cli": "#F0E442",
}
SERIES_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
OTHER_COLOUR = "#999999"

THROUGHPUT_METRICS = ("rate", "efficiency")
COST_METRICS = ("cpu_us", "p50_ms", "p95_ms", "p99_ms", "rss_mib")
CPU_PREFIX = "consumer CPU per message, "

FILES = ("throughput-ratios.svg", "cost-ratios.svg", "cpu-per-message.svg")


@dataclass(frozen=True)
class Bar:
    """One bar: its label line, the value it draws (median, min, max) and the texts beside it."""

    label: str
    value: float | None  # None: no data (the note says why)
    low: float | None
    high: float | None
    colour: str
    value_text: str
    note: str = ""  # right-aligned on the label line (the target and its result)
    target: float | None = None  # on the value's axis: drawn as a dashed line
    data: Mapping[str, str] | None = None  # data-* attributes of the bar (for tests, tools)


@dataclass(frozen=True)
class Group:
    title: str
    bars: tuple[Bar, ...]


# -- drawing ---------------------------------------------------------------------------------
class Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, tag: str, text: str | None = None, **attrs: object) -> None:
        a = " ".join(f"{_attr(k)}={quoteattr(_fmt(v))}" for k, v in attrs.items() if v is not None)
        if text is None:
            self.parts.append(f"<{tag} {a}/>")
        else:
            self.parts.append(f"<{tag} {a}>{escape(text)}</{tag}>")

    def text(self, x: float, y: float, text: str, size: float = 12, **attrs: object) -> None:
        self.add("text", text, x=x, y=y, font_size=size, **attrs)

    def document(self, height: float, title: str) -> str:
        head = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{_fmt(height)}" '
            f'viewBox="0 0 {WIDTH} {_fmt(height)}" font-family="{FONT}" fill="#222222">\n'
            f"<title>{escape(title)}</title>\n"
            f'<rect x="0" y="0" width="{WIDTH}" height="{_fmt(height)}" fill="#ffffff"/>\n'
        )
        return head + "\n".join(self.parts) + "\n</svg>\n"


def _attr(name: str) -> str:
    if name.startswith("data_"):
        return "data-" + name[5:].replace("_", "-")
    return name.rstrip("_").replace("_", "-")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return str(v)


def nice_step(top: float, ticks: int = 8) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that divides [0, top] into at most ``ticks``."""
    raw = top / ticks
    k = 10.0 ** math.floor(math.log10(raw))
    return next(m * k for m in (1, 2, 2.5, 5, 10) if m * k >= raw)


def axis_max(values: Iterable[float]) -> float:
    top = max([*values, 0.0]) or 1.0
    step = nice_step(top)
    return math.ceil(top / step - 1e-9) * step


def bar_chart(
    title: str,
    subtitle: Sequence[str],
    groups: Sequence[Group],
    *,
    tick_text: str = "{:g}",
    reference: float | None = None,
    cap: float | None = None,
    legend: Sequence[tuple[str, str]] = (),
    footer: Sequence[str] = (),
) -> str:
    """Horizontal bars in titled groups on one linear axis from 0; a label line above each bar."""
    extents = [
        x
        for g in groups
        for b in g.bars
        for x in (b.value, b.high, b.target, reference)
        if x is not None
    ]
    top = axis_max(extents)
    if cap is not None:
        top = min(top, cap)
    step = nice_step(top)
    scale = (PLOT_X1 - PLOT_X0) / top

    def x_of(v: float) -> float:
        return PLOT_X0 + v * scale

    svg = Svg()
    y = 26.0
    svg.text(PLOT_X0, y, title, 17, font_weight="bold")
    for line in subtitle:
        y += 17
        svg.text(PLOT_X0, y, line, 11.5, fill="#444444")
    if legend:
        y += 20
        x = PLOT_X0
        for name, colour in legend:
            svg.add("rect", x=x, y=y - 10, width=12, height=12, fill=colour, stroke="#333333")
            svg.text(x + 17, y, name, 12)
            x += 30 + 7.2 * len(name)
    y += 18
    plot_top = y
    ticks = [i * step for i in range(round(top / step) + 1)]
    tick_y = y + 4
    y += 14
    body: list[tuple[float, Group]] = []
    for g in groups:
        body.append((y, g))
        y += GROUP_H + ROW_H * len(g.bars)
    plot_bottom = y + 4

    # grid and axis labels (top and bottom), under the bars
    for t in ticks:
        x = x_of(t)
        svg.add("line", x1=x, y1=plot_top + 8, x2=x, y2=plot_bottom, stroke="#e3e3e3")
        for ty in (tick_y, plot_bottom + 14):
            svg.text(x, ty, tick_text.format(t), 11, text_anchor="middle", fill="#555555")
    if reference is not None:
        x = x_of(reference)
        svg.add(
            "line",
            x1=x,
            y1=plot_top + 8,
            x2=x,
            y2=plot_bottom,
            stroke="#555555",
            stroke_width=1.5,
            class_="reference",
        )

    for gy, g in body:
        svg.text(PLOT_X0 - 12, gy + 18, g.title, 13, font_weight="bold")
        svg.add("line", x1=PLOT_X0 - 12, y1=gy + 23, x2=WIDTH - 10, y2=gy + 23, stroke="#bbbbbb")
        for i, b in enumerate(g.bars):
            _bar(svg, b, gy + GROUP_H + i * ROW_H, x_of, top)

    y = plot_bottom + 34
    for line in footer:
        svg.text(PLOT_X0 - 12, y, line, 11.5, fill="#444444")
        y += 16
    return svg.document(y + 4, title)


def _bar(svg: Svg, b: Bar, y: float, x_of: Any, top: float) -> None:
    svg.text(PLOT_X0, y + 11, b.label, 12)
    if b.note:
        svg.text(WIDTH - 10, y + 11, b.note, 11, text_anchor="end", fill="#333333")
    by, bh = y + 16, 12.0
    mid = by + bh / 2
    if b.value is None:
        svg.text(PLOT_X0, mid + 4, b.value_text, 11.5, font_style="italic", fill="#555555")
        return
    data = {f"data_{k}": v for k, v in (b.data or {}).items()}
    if b.value > top:
        data["data_clipped"] = "1"
    end = x_of(min(b.value, top))
    svg.add(
        "rect",
        x=PLOT_X0,
        y=by,
        width=end - PLOT_X0,
        height=bh,
        fill=b.colour,
        stroke="#333333",
        stroke_width=0.6,
        class_="bar",
        **data,
    )
    if b.value > top:
        _arrow(svg, end, mid, "#111111")
        end += 8
    if b.low is not None and b.high is not None and b.high > b.low:
        lo, hi = x_of(min(b.low, top)), x_of(min(b.high, top))
        svg.add("line", x1=lo, y1=mid, x2=hi, y2=mid, stroke="#111111", stroke_width=1.4)
        svg.add("line", x1=lo, y1=by + 1, x2=lo, y2=by + bh - 1, stroke="#111111")
        if b.high > top:
            _arrow(svg, hi, mid, "#111111")
            hi += 8
        else:
            svg.add("line", x1=hi, y1=by + 1, x2=hi, y2=by + bh - 1, stroke="#111111")
        end = max(end, hi)
    if b.target is not None:
        x = x_of(b.target)
        svg.add(
            "line",
            x1=x,
            y1=by - 1,
            x2=x,
            y2=by + bh + 3,
            stroke="#111111",
            stroke_width=2.2,
            stroke_dasharray="3,2",
            class_="target",
        )
        end = max(end, x)
    svg.text(end + 6, mid + 4, b.value_text, 11.5)


def _arrow(svg: Svg, x: float, y: float, colour: str) -> None:
    """A value past the axis's end: a triangle pointing on."""
    svg.add(
        "path",
        d=f"M{_fmt(x)},{_fmt(y - 5)} L{_fmt(x + 8)},{_fmt(y)} L{_fmt(x)},{_fmt(y + 5)} Z",
        fill=colour,
        class_="past-axis",
    )


# -- the charts ------------------------------------------------------------------------------
def _colour(key: str) -> str:
    return CONTENDER_COLOURS.get(key, OTHER_COLOUR)


def _ratio_target(row: Mapping[str, Any]) -> float | None:
    """The value of a ratio target (``>= 0.9x raw``), which the ratio axis can show."""
    text = row.get("target") or ""
    if not text.startswith(">= ") or "x " not in text:
        return None
    try:
        return float(text[3:].split("x ", 1)[0])
    except ValueError:
        return None


def _result_note(row: Mapping[str, Any]) -> str:
    if not row.get("target"):
        return ""
    target = str(row["target"]).replace(">=", "\u2265").replace("<=", "\u2264")
    result = row.get("result") or ""
    if row.get("held_of"):
        result += f", held {row['held_in']}/{row['held_of']}"
    absolute = _ratio_target(row) is None and row.get("median") is not None
    value = f" (median {row['median']:,.{row['decimals']}f} {row['unit']})" if absolute else ""
    return f"target {target}{value}: {result}"


def ratio_groups(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> list[Group]:
    """Rows with a baseline, grouped by case label and unit, in the run's order."""
    groups: dict[str, list[Bar]] = {}
    for r in rows:
        if r["metric"] not in metrics or not r.get("baseline"):
            continue
        title = f"{r['case_label']} ({r['unit']})"
        label = f"{r['contender_label']} vs {r['baseline_label']}"
        if r.get("ratio") is None:
            why = r.get("error") or "no data"
            bar = Bar(label, None, None, None, _colour(r["contender"]), f"did not run: {why}"[:90])
        else:
            spread = ""
            if len(r["ratios"]) > 1:
                spread = f" ({r['ratio_min']:.2f}\u2013{r['ratio_max']:.2f})"
            bar = Bar(
                label,
                r["ratio"],
                r["ratio_min"],
                r["ratio_max"],
                _colour(r["contender"]),
                f"{r['ratio']:.2f}x{spread}",
                note=_result_note(r),
                target=_ratio_target(r),
                data={
                    "case": r["case"],
                    "contender": r["contender"],
                    "metric": r["metric"],
                    "ratio": f"{r['ratio']:.6g}",
                },
            )
        groups.setdefault(title, []).append(bar)
    return [Group(t, tuple(bars)) for t, bars in groups.items()]


def cpu_groups(rows: Sequence[Mapping[str, Any]]) -> tuple[list[Group], list[tuple[str, str]]]:
    """CPU per message by contender, one bar per consume case; and the cases' legend."""
    series: dict[str, str] = {}
    by_contender: dict[str, tuple[str, list[Bar]]] = {}
    for r in rows:
        if r["metric"] != "cpu_us":
            continue
        name = r["case_label"].removeprefix(CPU_PREFIX).removeprefix("guard + results, ")
        if r["case"] == "processes":
            name += " (the --processes case)"
        colour = series.setdefault(name, SERIES_COLOURS[len(series) % len(SERIES_COLOURS)])
        _, bars = by_contender.setdefault(r["contender"], (r["contender_label"], []))
        if r["median"] is None:
            why = r.get("error") or "no data"
            bars.append(Bar(name, None, None, None, colour, f"did not run: {why}"[:90]))
            continue
        spread = f" ({r['min']:,.0f}\u2013{r['max']:,.0f})" if r["max"] > r["min"] else ""
        bars.append(
            Bar(
                name,
                r["median"],
                r["min"],
                r["max"],
                colour,
                f"{r['median']:,.0f} us{spread}",
                note=f"{r['ratio']:.2f}x {r['baseline_label']}" if r.get("ratio") else "",
                data={
                    "case": r["case"],
                    "contender": r["contender"],
                    "metric": r["metric"],
                    "value": f"{r['median']:.6g}",
                },
            )
        )
    groups = [Group(label, tuple(bars)) for label, bars in by_contender.values()]
    return groups, list(series.items())


def run_lines(header: Mapping[str, Any]) -> list[str]:
    m = header.get("machine", {})
    load = ""
    if m.get("loadavg_start") and m.get("loadavg_end"):
        start, end = m["loadavg_start"][0], m["loadavg_end"][0]
        load = f"; load average {start:.2f} at start, {end:.2f} at end"
    pk = header.get("packages", {})
    versions = ", ".join(f"{k} {pk[k]}" for k in ("weclaw_mq", "aio-pika", "redis") if k in pk)
    return [
        f"Run {header.get('run_id', '?')}, {header.get('date', '?')}: {header.get('mode', '?')}, "
        f"{header.get('repeats', '?')} repeats, interleaved",
        f"{m.get('nproc', '?')} CPUs{load}; RabbitMQ {header.get('rabbitmq', '?')}, "
        f"Redis {header.get('redis', '?')}",
        f"Python {header.get('python', '?')}; {versions}",
    ]


RATIO_FOOTER = (
    "Bar: the median of the paired per-repeat ratios (repeat i over its baseline's repeat i, "
    "same round).",
    "Whisker: their min-max. Dashed mark: a ratio target. Grey line: 1x, the baseline. "
    "Targets are met on the median.",
    f"The axis ends at {RATIO_AXIS_CAP:g}x: an arrow marks a bar or whisker that goes on "
    "(its text gives the value).",
)


def render_all(payload: Mapping[str, Any]) -> dict[str, str]:
    """File name -> SVG text, for one run's JSON (``bench.py``'s payload)."""
    header, rows = payload.get("header", {}), payload["rows"]
    lines = run_lines(header)
    cpu, series = cpu_groups(rows)
    return {
        "throughput-ratios.svg": bar_chart(
            "Throughput against each row's baseline (higher is better)",
            lines,
            ratio_groups(rows, THROUGHPUT_METRICS),
            tick_text="{:g}x",
            reference=1.0,
            cap=RATIO_AXIS_CAP,
            footer=RATIO_FOOTER,
        ),
        "cost-ratios.svg": bar_chart(
            "CPU, latency and memory against each row's baseline (lower is better)",
            lines,
            ratio_groups(rows, COST_METRICS),
            tick_text="{:g}x",
            reference=1.0,
            cap=RATIO_AXIS_CAP,
            footer=RATIO_FOOTER,
        ),
        "cpu-per-message.svg": bar_chart(
            "Consumer CPU per message, us (lower is better)",
            lines,
            cpu,
            legend=series,
            footer=(
                "The consumer process's CPU time (all threads) from first delivery to last ack, "
                "over the messages.",
                "Bar: median over the repeats; whisker: min-max. Right: the paired ratio to the "
                "row's baseline.",
            ),
        ),
    }


def write_plots(payload: Mapping[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all(payload).items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__)
    p.add_argument("results", type=Path, help="a run's JSON (benchmarks/results/latest.json)")
    p.add_argument("--out", type=Path, default=None, help="where the SVGs go (default: beside it)")
    p.add_argument(
        "--table",
        action="store_true",
        help="also write table.md there: the run's table under three lines saying when, how "
        "and on what it ran (what the docs' performance page includes)",
    )
    args = p.parse_args(argv)
    payload = json.loads(args.results.read_text(encoding="utf-8"))
    out = args.out or args.results.parent
    for path in write_plots(payload, out):
        print(path)
    if args.table:
        (out / "table.md").write_text(docs_table(payload["header"], payload["rows"]))
        print(out / "table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

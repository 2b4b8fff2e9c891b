"""benchmarks/plots.py draws a run's rows as SVG: every ratio row and every CPU row appears,
named in text, and a bar's length is proportional to the value it stands for.

The fixture is a small run made with the report's own structures (``Results``, ``RowSpec``,
``Target``, the cases' contenders), so its rows have exactly the shape ``bench.py`` writes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from benchmarks import plots
from benchmarks.cases import DRAMATIQ, FASTSTREAM, RAW, RAW_REDIS, WECLAW, WECLAW_GUARD, Contender
from benchmarks.report import Results, RowSpec, Target, markdown_table

SVG = "{http://www.w3.org/2000/svg}"

# repeat -> (msg/s, us CPU per message), per consume case and contender
CONSUME: dict[int, dict[Contender, list[tuple[float, float]]]] = {
    1: {
        RAW: [(1600, 235), (1500, 216), (1800, 259)],
        WECLAW: [(2800, 209), (2700, 170), (3000, 250)],
        RAW_REDIS: [(950, 543), (870, 454), (1050, 640)],
        WECLAW_GUARD: [(1670, 458), (1450, 388), (1850, 535)],
        FASTSTREAM: [(1520, 283), (1350, 266), (1690, 342)],
    },
    10: {
        RAW: [(6400, 142), (5000, 121), (7600, 176)],
        WECLAW: [(6900, 137), (4400, 122), (7150, 177)],
        RAW_REDIS: [(2470, 354), (1050, 291), (3200, 435)],
        WECLAW_GUARD: [(3700, 242), (3090, 230), (4090, 260)],
        FASTSTREAM: [(4500, 208), (4000, 191), (4800, 228)],
    },
}


def _baseline(c: Contender) -> Contender | None:
    return RAW_REDIS if c is WECLAW_GUARD else (None if c is RAW else RAW)


def fixture_run() -> dict[str, Any]:
    results = Results()
    for k, by_contender in CONSUME.items():
        case = f"consume-c{k}"
        for metric, label, unit in (
            ("rate", f"consume no-op, c={k}", "msg/s"),
            ("cpu_us", f"consumer CPU per message, c={k}", "us CPU/msg"),
        ):
            for c in [*by_contender, DRAMATIQ]:
                base = _baseline(c)
                target = None
                if metric == "rate" and c is WECLAW and k == 10:
                    target = Target("ratio_min", 0.9, every=True)
                if metric == "rate" and c is WECLAW_GUARD:
                    target = Target("ratio_min", 0.9)
                results.add_spec(
                    RowSpec(
                        case,
                        label,
                        c.key,
                        c.label,
                        metric,
                        unit,
                        baseline=base.key if base else None,
                        baseline_label=base.short if base else None,
                        target=target,
                    )
                )
        for c, repeats in by_contender.items():
            for r, (rate, cpu) in enumerate(repeats):
                results.record(case, c.key, r, {"rate": rate, "cpu_us": cpu})
        results.fail(case, DRAMATIQ.key, "ContenderFailed: its worker exited with 1")
    # an absolute target on a ratio row (I/O efficiency >= 0.9 of the bound)
    for c in (RAW, WECLAW):
        results.add_spec(
            RowSpec(
                "io-c8",
                "I/O 50 ms handler, c=8",
                c.key,
                c.label,
                "efficiency",
                "x bound (160/s)",
                baseline=None if c is RAW else RAW.key,
                baseline_label=None if c is RAW else RAW.short,
                target=None if c is RAW else Target("min", 0.9),
                decimals=3,
            )
        )
    for r, (raw, ours) in enumerate([(0.945, 0.971), (0.939, 0.975), (0.947, 0.971)]):
        results.record("io-c8", RAW.key, r, {"efficiency": raw})
        results.record("io-c8", WECLAW.key, r, {"efficiency": ours})
    header = {
        "run_id": "bench-1202150000-abcd",
        "date": "2026-12-02 15:00 UTC",
        "mode": "scale 0.4",
        "repeats": 3,
        "machine": {
            "nproc": 2,
            "cpu": "Intel Xeon",
            "ram_gib": 23.5,
            "kernel": "6.1",
            "loadavg_start": [0.5, 0.4, 0.3],
            "loadavg_end": [0.9, 0.6, 0.4],
        },
        "wall_s": 362.4,
        "python": "3.11.7",
        "packages": {"weclaw_mq": "0.1.0", "aio-pika": "10.2.1", "redis": "8.1.0"},
        "rabbitmq": "3.10.8",
        "redis": "7.0.15",
    }
    # as bench.py writes it, through JSON
    run: dict[str, Any] = json.loads(
        json.dumps({"header": header, "rows": results.rows(), "runs": []})
    )
    return run


@pytest.fixture(scope="module")
def charts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ET.Element]:
    out = tmp_path_factory.mktemp("plots")
    src = out / "latest.json"
    src.write_text(json.dumps(fixture_run()))
    assert plots.main([str(src), "--out", str(out / "svg"), "--table"]) == 0
    return {name: ET.parse(out / "svg" / name).getroot() for name in plots.FILES}


def test_the_docs_table_says_how_the_run_was_made_above_the_runs_table(
    tmp_path: Path,
) -> None:
    run = fixture_run()
    src = tmp_path / "latest.json"
    src.write_text(json.dumps(run))
    assert plots.main([str(src), "--table"]) == 0
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[0].startswith("- Run bench-1202150000-abcd, 2026-12-02 15:00 UTC: ")
    assert "`benchmarks/run.sh --scale 0.4 --repeats 3`" in lines[0]
    assert "load average (1 / 5 / 15 min) 0.50 / 0.40 / 0.30 at the start" in lines[1]
    assert lines[2].startswith("- weclaw_mq 0.1.0; RabbitMQ 3.10.8")
    assert "\n".join(lines[4:]) == markdown_table(run["rows"])


def texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def bars(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]


def test_every_ratio_row_appears_under_its_case_named_with_its_baseline(
    charts: dict[str, ET.Element],
) -> None:
    rows = fixture_run()["rows"]
    for name, metrics in (
        ("throughput-ratios.svg", plots.THROUGHPUT_METRICS),
        ("cost-ratios.svg", plots.COST_METRICS),
    ):
        words = texts(charts[name])
        for r in rows:
            if r["metric"] not in metrics or not r["baseline"]:
                continue
            assert f"{r['case_label']} ({r['unit']})" in words
            assert f"{r['contender_label']} vs {r['baseline_label']}" in words
            if r["ratio"] is None:
                assert any(w.startswith("did not run: ContenderFailed") for w in words)
        drawn = {(b.get("data-case"), b.get("data-contender")) for b in bars(charts[name])}
        expected = {
            (r["case"], r["contender"])
            for r in rows
            if r["metric"] in metrics and r["ratio"] is not None
        }
        assert drawn == expected


def test_a_ratio_bar_is_as_long_as_its_ratio_and_the_targets_are_drawn(
    charts: dict[str, ET.Element],
) -> None:
    root = charts["throughput-ratios.svg"]
    assert not [b for b in bars(root) if b.get("data-clipped")]
    per_unit = [float(b.get("width", 0)) / float(b.get("data-ratio", 0)) for b in bars(root)]
    assert len(per_unit) == 9  # 4 contenders x 2 consume cases, and the I/O row
    assert max(per_unit) - min(per_unit) < 0.01 * max(per_unit)
    # the c=10 guard-off row: 6900/6400, 4400/5000, 7150/7600 paired, median 7150/7600
    c10 = next(
        b
        for b in bars(root)
        if b.get("data-case") == "consume-c10" and b.get("data-contender") == "weclaw"
    )
    assert float(c10.get("data-ratio", 0)) == pytest.approx(7150 / 7600)
    targets = [line for line in root.iter(f"{SVG}line") if line.get("class") == "target"]
    assert len(targets) == 3  # the ratio targets; the I/O target is absolute, in the note
    words = texts(root)
    assert "target \u2265 0.9x raw in every repeat: MISS, held 2/3" in words
    assert "target \u2265 0.9 (median 0.971 x bound (160/s)): pass, held 3/3" in words
    # the 1x line lies where a ratio of 1 would end
    (ref,) = [line for line in root.iter(f"{SVG}line") if line.get("class") == "reference"]
    assert float(ref.get("x1", 0)) - plots.PLOT_X0 == pytest.approx(per_unit[0], rel=0.01)


def test_cpu_chart_has_a_group_per_contender_and_a_bar_per_concurrency(
    charts: dict[str, ET.Element],
) -> None:
    root = charts["cpu-per-message.svg"]
    words = texts(root)
    for c in (RAW, WECLAW, RAW_REDIS, WECLAW_GUARD, FASTSTREAM, DRAMATIQ):
        assert c.label in words
    assert {"c=1", "c=10"} <= set(words)
    drawn = {(b.get("data-case"), b.get("data-contender")): b for b in bars(root)}
    assert len(drawn) == 10  # 5 contenders x 2 cases; Dramatiq did not run
    per_us = [float(b.get("width", 0)) / float(b.get("data-value", 0)) for b in drawn.values()]
    assert max(per_us) - min(per_us) < 0.01 * max(per_us)
    assert float(drawn[("consume-c10", "raw")].get("data-value", 0)) == 142


def test_a_ratio_past_the_axis_end_is_cut_there_with_an_arrow_and_its_text_says_it() -> None:
    def arrows(root: ET.Element) -> int:
        return len([p for p in root.iter(f"{SVG}path") if p.get("class") == "past-axis"])

    run = fixture_run()
    before = arrows(ET.fromstring(plots.render_all(run)["throughput-ratios.svg"]))
    row = next(r for r in run["rows"] if r["metric"] == "rate" and r["contender"] == "faststream")
    row.update(ratio=4.69, ratio_min=3.1, ratio_max=8.12, ratios=[3.1, 4.69, 8.12])
    root = ET.fromstring(plots.render_all(run)["throughput-ratios.svg"])
    (bar,) = [b for b in bars(root) if b.get("data-clipped")]
    assert float(bar.get("x", 0)) + float(bar.get("width", 0)) == pytest.approx(plots.PLOT_X1)
    assert arrows(root) == before + 2  # the bar's and its whisker's
    assert "4.69x (3.10\u20138.12)" in texts(root)
    assert "2.5x" in texts(root)  # the last tick: the axis stops at the cap


def test_the_same_run_gives_the_same_bytes() -> None:
    assert plots.render_all(fixture_run()) == plots.render_all(fixture_run())

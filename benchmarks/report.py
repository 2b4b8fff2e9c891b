"""Rows, targets and the two renderings of a run: a markdown table and JSON.

Ratios are paired: every repeat runs every contender once, in one rotated round
(``cases.Bench._case``), so repeat i of a contender is divided by repeat i of its baseline,
which ran minutes apart at most under the same machine load. A row shows the median of those
per-repeat ratios with their min and max; a target is met when it holds for the median, and
the row also says in how many repeats it held.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    """``ratio_min``: the median paired ratio >= value; ``min`` / ``max``: on the median value."""

    kind: Literal["ratio_min", "min", "max"]
    value: float
    every: bool = False  # met only when it held in every repeat, not only on the median

    def text(self, baseline_label: str | None) -> str:
        if self.kind == "ratio_min":
            text = f">= {self.value:g}x {baseline_label}"
        else:
            text = f"{'>=' if self.kind == 'min' else '<='} {self.value:g}"
        return f"{text} in every repeat" if self.every else text

    def met(self, median: float, ratio: float | None) -> bool | None:
        """On the medians: the row's median value, or its median paired ratio."""
        if self.kind == "ratio_min":
            return None if ratio is None else ratio >= self.value
        return median >= self.value if self.kind == "min" else median <= self.value

    def held(self, values: Mapping[int, float], ratios: Mapping[int, float]) -> dict[int, bool]:
        """Per repeat: did the target hold for that repeat's value (or paired ratio)?"""
        if self.kind == "ratio_min":
            return {r: ratio >= self.value for r, ratio in ratios.items()}
        if self.kind == "min":
            return {r: v >= self.value for r, v in values.items()}
        return {r: v <= self.value for r, v in values.items()}


def paired_ratios(values: Mapping[int, float], baseline: Mapping[int, float]) -> dict[int, float]:
    """Repeat -> value / baseline value of the same repeat (the same rotated round).

    A repeat in which either side failed, or the baseline measured 0, has no ratio: it is
    left out rather than paired with another round's baseline.
    """
    return {r: v / baseline[r] for r, v in sorted(values.items()) if baseline.get(r)}


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float


def spread(values: Mapping[int, float]) -> Spread | None:
    if not values:
        return None
    xs = list(values.values())
    return Spread(statistics.median(xs), min(xs), max(xs))


@dataclass(frozen=True)
class RowSpec:
    case_id: str  # also names the case in the JSON
    case_label: str
    contender: str  # contender key
    contender_label: str
    metric: str  # key in the sample dict a run returns
    unit: str
    baseline: str | None = None  # contender key of this case's baseline
    baseline_label: str | None = None
    target: Target | None = None
    decimals: int = 0


@dataclass
class Results:
    specs: list[RowSpec] = field(default_factory=list)
    # (case, contender, metric) -> repeat -> value: keyed by repeat, so ratios pair rounds
    samples: dict[tuple[str, str, str], dict[int, float]] = field(default_factory=dict)
    failures: dict[tuple[str, str], str] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)  # every run, raw, for the JSON

    def add_spec(self, spec: RowSpec) -> None:
        if spec not in self.specs:
            self.specs.append(spec)

    def record(self, case_id: str, contender: str, repeat: int, metrics: dict[str, float]) -> None:
        for metric, value in metrics.items():
            self.samples.setdefault((case_id, contender, metric), {})[repeat] = value

    def fail(self, case_id: str, contender: str, reason: str) -> None:
        self.failures[(case_id, contender)] = reason

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(s) for s in self.specs]

    def row(self, s: RowSpec) -> dict[str, Any]:
        values = self.samples.get((s.case_id, s.contender, s.metric), {})
        base = self.samples.get((s.case_id, s.baseline, s.metric), {}) if s.baseline else {}
        ratios = paired_ratios(values, base) if s.baseline else {}
        v, q = spread(values), spread(ratios)
        row: dict[str, Any] = {
            "case": s.case_id,
            "case_label": s.case_label,
            "contender": s.contender,
            "contender_label": s.contender_label,
            "metric": s.metric,
            "unit": s.unit,
            "values": [values[r] for r in sorted(values)],
            "repeats": sorted(values),
            "median": v.median if v else None,
            "min": v.min if v else None,
            "max": v.max if v else None,
            "baseline": s.baseline,
            # the median, min and max of the paired per-repeat ratios
            "ratios": [ratios[r] for r in sorted(ratios)],
            "ratio": q.median if q else None,
            "ratio_min": q.min if q else None,
            "ratio_max": q.max if q else None,
            "target": s.target.text(s.baseline_label) if s.target else None,
            "result": None,
            "held_in": None,  # repeats in which the target held
            "held_of": None,  # repeats it could be checked in
            "error": self.failures.get((s.case_id, s.contender)),
            "decimals": s.decimals,
            "baseline_label": s.baseline_label,
        }
        if s.target is not None:
            if v is None:
                row["result"] = "miss (no data)"
            else:
                met = s.target.met(v.median, row["ratio"])
                held = s.target.held(values, ratios)
                if met is not None and s.target.every:
                    met = bool(held) and all(held.values())
                row["result"] = "n/a" if met is None else ("pass" if met else "MISS")
                row["held_in"] = sum(held.values())
                row["held_of"] = len(held)
        return row


def _num(value: float | None, decimals: int) -> str:
    return "-" if value is None else f"{value:,.{decimals}f}"


def ratio_text(row: Mapping[str, Any]) -> str:
    """``0.92x raw (0.88-0.95)``: the median paired ratio, then min-max when repeats differ."""
    if row["ratio"] is None or not row["baseline_label"]:
        return ""
    text = f"{row['ratio']:.2f}x {row['baseline_label']}"
    if len(row["ratios"]) > 1:
        text += f" ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
    return text


def result_text(row: Mapping[str, Any]) -> str:
    """``pass``/``MISS`` on the median, and in how many repeats the target held."""
    result = row["result"] or ""
    if row["held_of"]:
        k, n = row["held_in"], row["held_of"]
        result += f" (held in every repeat, {k}/{n})" if k == n else f" (held in {k}/{n} repeats)"
    if row["error"]:
        result = f"{result} (some repeats failed: {_cell(row['error'])})".strip()
    return result


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | contender | median | min | max | unit | ratio (paired: median (min-max)) "
        "| target | result |",
        "|---|---|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        d = r["decimals"]
        if r["median"] is None:
            why = r["error"] or "no data"
            lines.append(
                f"| {r['case_label']} | {r['contender_label']} | - | - | - | {r['unit']} | - | "
                f"{r['target'] or ''} | did not run: {_cell(why)} |"
            )
            continue
        lines.append(
            f"| {r['case_label']} | {r['contender_label']} | {_num(r['median'], d)} | "
            f"{_num(r['min'], d)} | {_num(r['max'], d)} | {r['unit']} | {ratio_text(r)} | "
            f"{r['target'] or ''} | {result_text(r)} |"
        )
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "/").split())[:300]


def header_markdown(header: dict[str, Any]) -> str:
    m = header["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in header["packages"].items())
    lines = [
        f"Run {header['run_id']} on {header['date']} ({header['mode']}, "
        f"{header['repeats']} repeat(s), interleaved; wall time {header['wall_s']:.0f} s)",
        "",
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, "
        f"kernel {m['kernel']}; load average at start "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg_end'])}",
        f"- RabbitMQ {header['rabbitmq']} (single node, quorum queues), Redis {header['redis']}",
        f"- Python {header['python']}; {versions}",
        f"- counts: {header['counts']}",
    ]
    return "\n".join(lines)


def render(header: dict[str, Any], rows: list[dict[str, Any]], notes: list[str]) -> str:
    parts = [
        "# weclaw_mq benchmark",
        "",
        header_markdown(header),
        "",
        markdown_table(rows),
        "",
        "Notes:",
        *[f"- {n}" for n in notes],
    ]
    return "\n".join(parts) + "\n"


def run_command(header: Mapping[str, Any]) -> str:
    """The ``benchmarks/run.sh`` call that made a run, from its header (mode and repeats)."""
    mode = str(header["mode"])
    if mode == "smoke":
        return "benchmarks/run.sh --smoke"
    args = [] if mode == "scale 1" else ["--scale", mode.removeprefix("scale ")]
    return " ".join(["benchmarks/run.sh", *args, "--repeats", str(header["repeats"])])


def docs_table(header: Mapping[str, Any], rows: list[dict[str, Any]]) -> str:
    """The run's table under three lines saying when, how and on what it was made (the docs'
    performance page includes it, beside the charts of the same JSON)."""
    m = header["machine"]
    pk = header["packages"]
    load = " / ".join(f"{x:.2f}" for x in m["loadavg_start"])
    load_end = " / ".join(f"{x:.2f}" for x in m["loadavg_end"])
    versions = ", ".join(f"{k} {v}" for k, v in pk.items() if k != "weclaw_mq")
    lines = [
        f"- Run {header['run_id']}, {header['date']}: `{run_command(header)}` ({header['mode']} "
        f"of `make bench`'s counts, {header['repeats']} repeats interleaved; the comparison's "
        f"wall time {header['wall_s']:.0f} s, then the feature benchmarks).",
        f"- Machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, shared with other "
        f"work: load average (1 / 5 / 15 min) {load} at the start, {load_end} at the end.",
        f"- weclaw_mq {pk.get('weclaw_mq', '?')}; RabbitMQ {header['rabbitmq']} (single node, "
        f"quorum queues), Redis {header['redis']}; Python {header['python']}; {versions}.",
    ]
    return "\n".join([*lines, "", markdown_table(rows)]) + "\n"

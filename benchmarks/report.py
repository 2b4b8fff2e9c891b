"""Rows, targets and the two renderings of a run: a markdown table and JSON."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    """``ratio_min``: median / baseline median >= value; ``min`` / ``max``: on the median."""

    kind: Literal["ratio_min", "min", "max"]
    value: float

    def text(self, baseline_label: str | None) -> str:
        if self.kind == "ratio_min":
            return f">= {self.value:g}x {baseline_label}"
        return f"{'>=' if self.kind == 'min' else '<='} {self.value:g}"

    def met(self, median: float, ratio: float | None) -> bool | None:
        if self.kind == "ratio_min":
            return None if ratio is None else ratio >= self.value
        return median >= self.value if self.kind == "min" else median <= self.value


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
    samples: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    failures: dict[tuple[str, str], str] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)  # every run, raw, for the JSON

    def add_spec(self, spec: RowSpec) -> None:
        if spec not in self.specs:
            self.specs.append(spec)

    def record(self, case_id: str, contender: str, metrics: dict[str, float]) -> None:
        for metric, value in metrics.items():
            self.samples.setdefault((case_id, contender, metric), []).append(value)

    def fail(self, case_id: str, contender: str, reason: str) -> None:
        self.failures[(case_id, contender)] = reason

    def median(self, case_id: str, contender: str, metric: str) -> float | None:
        values = self.samples.get((case_id, contender, metric))
        return statistics.median(values) if values else None

    def rows(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for s in self.specs:
            values = self.samples.get((s.case_id, s.contender, s.metric), [])
            row: dict[str, Any] = {
                "case": s.case_id,
                "case_label": s.case_label,
                "contender": s.contender,
                "contender_label": s.contender_label,
                "metric": s.metric,
                "unit": s.unit,
                "values": values,
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "baseline": s.baseline,
                "ratio": None,
                "target": s.target.text(s.baseline_label) if s.target else None,
                "result": None,
                "error": self.failures.get((s.case_id, s.contender)),
                "decimals": s.decimals,
                "baseline_label": s.baseline_label,
            }
            base = self.median(s.case_id, s.baseline, s.metric) if s.baseline else None
            if row["median"] is not None and base:
                row["ratio"] = row["median"] / base
            if s.target is not None:
                if row["median"] is None:
                    row["result"] = "miss (no data)"
                else:
                    met = s.target.met(row["median"], row["ratio"])
                    row["result"] = "n/a" if met is None else ("pass" if met else "MISS")
            out.append(row)
        return out


def _num(value: float | None, decimals: int) -> str:
    return "-" if value is None else f"{value:,.{decimals}f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | contender | median | min | max | unit | ratio | target | result |",
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
        ratio = ""
        if r["ratio"] is not None and r["baseline_label"]:
            ratio = f"{r['ratio']:.2f}x {r['baseline_label']}"
        result = r["result"] or ""
        if r["error"]:
            result = f"{result} (some repeats failed: {_cell(r['error'])})".strip()
        lines.append(
            f"| {r['case_label']} | {r['contender_label']} | {_num(r['median'], d)} | "
            f"{_num(r['min'], d)} | {_num(r['max'], d)} | {r['unit']} | {ratio} | "
            f"{r['target'] or ''} | {result} |"
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

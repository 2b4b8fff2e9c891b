"""Where a missed target's cost goes: printed under the table for every MISS of ours (and
for guard-off consume at c=10, whatever its result).

- A throughput or latency miss (consume, I/O, publish): the measurement runs once more with
  the weclaw_mq process under cProfile; the summary gives the share of the process's own
  time (tottime) by package (weclaw_mq, redis-py, aio-pika/aiormq/pamqp, pydantic, asyncio,
  the rest) and the functions that cost most. cProfile slows everything it profiles about
  evenly: read the shares, not the times.
- The multi-process case: its children are not profiled; its row pairs with the one-process
  CPU per message (the cost of a message in each process), which the table already shows.
- An RSS miss: a fresh interpreter imports what a worker imports, one layer at a time, and
  prints VmRSS after each: what each layer adds (``rss_layers.py``, also ``make bench-rss``).
"""

from __future__ import annotations

import os
import pstats
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from .cases import Bench

OURS = ("weclaw", "weclaw-guard", "weclaw-results")
ALWAYS = {("consume-c10", "weclaw")}
PACKAGES = {
    "weclaw_mq": "weclaw_mq",
    "redis": "redis-py",
    "hiredis": "redis-py",
    "aio_pika": "aio-pika/aiormq/pamqp",
    "aiormq": "aio-pika/aiormq/pamqp",
    "pamqp": "aio-pika/aiormq/pamqp",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",
    "asyncio": "asyncio (the event loop)",
    "selectors": "asyncio (the event loop)",
    "prometheus_client": "prometheus_client",
    "json": "json",
}


def package_of(filename: str) -> str:
    if filename.startswith(("~", "<")):
        return "builtins (C calls)"
    parts = Path(filename).parts
    if "weclaw_mq" in parts:
        return "weclaw_mq"
    if "site-packages" in parts:
        top = parts[parts.index("site-packages") + 1].removesuffix(".py")
        return PACKAGES.get(top, top)
    if "asyncio" in parts or Path(filename).stem == "selectors":
        return "asyncio (the event loop)"
    return PACKAGES.get(Path(filename).stem, f"stdlib {Path(filename).stem}")


def profile_summary(path: Path, top: int = 8) -> list[str]:
    stats = pstats.Stats(str(path))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    by_package: Counter[str] = Counter()
    functions: list[tuple[float, str]] = []
    for (filename, line, name), (_cc, _nc, tottime, _ct, _callers) in raw.items():
        by_package[package_of(filename)] += tottime
        functions.append(
            (tottime, f"{package_of(filename)}: {name} ({Path(filename).name}:{line})")
        )
    total = sum(by_package.values()) or 1.0
    lines = [
        "  own time by package: "
        + ", ".join(f"{pkg} {t / total:.0%}" for pkg, t in by_package.most_common(7))
    ]
    lines.append("  costliest functions (own time):")
    for t, where in sorted(functions, reverse=True)[:top]:
        lines.append(f"    {t / total:5.1%}  {where}")
    return lines


def rss_lines() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.rss_layers"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return ["  " + line for line in out.stdout.splitlines()]


async def explain_misses(bench: Bench, rows: list[dict[str, Any]], out_dir: Path) -> str:
    """A profile summary for each of our contenders' MISS rows (see the module)."""
    # Profiled whatever its result: at c=10 without the guard our own work is the largest
    # share of a delivery, so that is where it shows (issue 17).
    missed = [r for r in rows if r["result"] == "MISS" or (r["case"], r["contender"]) in ALWAYS]
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    rss: list[str] = []
    for row in missed:
        case, key = row["case"], row["contender"]
        if (case, key) in seen:
            continue
        seen.add((case, key))
        verdict = "MISS" if row["result"] == "MISS" else "profiled"
        title = f"{verdict}: {row['case_label']} / {row['contender_label']} ({row['target']})"
        if case == "rss" and key in OURS:
            lines += [title, *(["  (the breakdown above)"] if rss else (rss := rss_lines()))]
            continue
        if case not in bench.runners or key not in OURS:
            if key == "weclaw-guard-p2":
                lines += [title, *cores_lines(rows, case)]
            continue
        contenders, run = bench.runners[case]
        bench.children.cprofile_dir = out_dir
        try:
            await run(contenders[key], 900 + len(seen))
        except Exception as e:  # the table stands without the profile
            lines += [title, f"  (could not profile it: {type(e).__name__}: {e})"]
            continue
        finally:
            bench.children.cprofile_dir = None
        profile = out_dir / f"{bench.infra.run_id}-{case}-{key}-r{900 + len(seen)}.prof"
        lines.append(title)
        lines += profile_summary(profile)
    return "\n".join(lines)


def cores_lines(rows: list[dict[str, Any]], case: str) -> list[str]:
    """Where the cores went in the multi-process case: a second worker process can only use
    what one process, the broker and Redis leave free of the machine (medians of the repeats)."""
    cores = {
        (r["contender"], r["metric"]): r["median"]
        for r in rows
        if r["case"] == case and r["unit"] == "cores" and r["median"] is not None
    }
    out = []
    for key, what in (("weclaw-guard", "one process"), ("weclaw-guard-p2", "two processes")):
        parts = [
            f"{name} {cores[(key, metric)]:.2f}"
            for metric, name in (
                ("worker_cores", "worker(s)"),
                ("broker_cores", "broker"),
                ("redis_cores", "Redis"),
                ("machine_cores", "whole machine"),
            )
            if (key, metric) in cores
        ]
        if parts:
            out.append(f"  {what}: cores used (of {os.cpu_count()}): " + ", ".join(parts))
    out.append(
        "  a second process adds only what the first left free of the machine's cores, after "
        "RabbitMQ and Redis (which grow with the rate: each message costs the broker and Redis "
        "CPU too); CPU per message summed over the children is the other row of this case."
    )
    return out

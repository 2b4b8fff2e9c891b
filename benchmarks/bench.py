"""weclaw_mq against raw aio-pika, FastStream and Dramatiq, in one run on one broker.

Run it through ``benchmarks/run.sh`` (its own venv). Each measurement runs a contender in
its own process (own event loop, own RSS); contenders are interleaved and each case repeated
(median, min, max); a ratio pairs each repeat with its baseline's run in the same round.
Consume cases time a pre-filled queue from the first delivery to the last ack. The table goes
to stdout and, with the JSON and its SVG charts (``plots.py``), to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .cases import CASES, EXTRA_CASES, FULL, OURS_AND_BASELINES, SMOKE, Bench, log, notes
from .costs import explain_misses
from .infra import ROOT, Children, Infra, machine_info, package_versions
from .machine_cpu import CpuWindow
from .plots import write_plots
from .report import render

RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_REPEATS = 5
PACKAGES = (
    "weclaw_mq",
    "aio-pika",
    "aiormq",
    "pamqp",
    "redis",
    "pydantic",
    "faststream",
    "dramatiq",
    "pika",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/run.sh", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny counts, 1 repeat (< 60 s)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply message counts (0.2)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"repeats per case (default {DEFAULT_REPEATS}; 1 with --smoke)",
    )
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (or {','.join(EXTRA_CASES)})",
    )
    p.add_argument("--skip-peers", action="store_true", help="leave FastStream and Dramatiq out")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated contender keys to run (raw, raw-redis, weclaw, weclaw-guard, "
        "weclaw-results, faststream, dramatiq, dramatiq-cli); the others get no rows",
    )
    p.add_argument(
        "--amqp-url",
        default=os.environ.get("WECLAW_MQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    p.add_argument(
        "--redis-url", default=os.environ.get("WECLAW_MQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where latest.json and README-table.md go (default benchmarks/results/, and "
        "benchmarks/results/smoke/ with --smoke, so a smoke run never replaces a full one)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="run weclaw_mq's processes under pyinstrument (results/profiles/); timings "
        "are then NOT comparable",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = RESULTS_DIR / "smoke" if args.smoke else RESULTS_DIR
    unknown = set(args.cases.split(",")) - set(CASES) - set(EXTRA_CASES)
    if unknown:
        p.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    return args


async def amain(args: argparse.Namespace) -> int:
    counts = SMOKE if args.smoke else FULL.scaled(args.scale)
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else DEFAULT_REPEATS)
    run_id = f"bench-{datetime.now(UTC):%m%d%H%M%S}-{uuid.uuid4().hex[:4]}"
    infra = Infra(args.amqp_url, args.redis_url, run_id)
    children = Children(args.out / "profiles" if args.profile else None)
    children.cpu_window = CpuWindow(args.amqp_url, args.redis_url)
    bench = Bench(
        infra=infra,
        children=children,
        counts=counts,
        repeats=repeats,
        cases=tuple(args.cases.split(",")),
        skip_peers=args.skip_peers,
        only=frozenset(k for k in args.only.split(",") if k),
    )
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    # Ctrl-C or a TERM cancels the run; the finally below still deletes every queue and key.
    # (SIGINT explicitly: a shell that starts us in the background leaves it ignored.)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    started = time.monotonic()
    header: dict[str, Any] = {
        "run_id": run_id,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "smoke" if args.smoke else f"scale {args.scale:g}",
        "repeats": repeats,
        "machine": machine_info(),
        "python": platform.python_version(),
        "packages": package_versions(PACKAGES),
        "counts": asdict(counts),
        "profiled": args.profile,
    }
    try:
        await infra.open()
        header["rabbitmq"] = infra.server_version()
        header["redis"] = (await infra.redis.info("server")).get("redis_version", "?")
        log(f"bench {run_id}: {header['mode']}, {repeats} repeat(s), cases {args.cases}")
        await bench.run_all()
    finally:
        children.kill_all()
        await infra.close()
    header["wall_s"] = time.monotonic() - started
    header["machine"]["loadavg_end"] = list(os.getloadavg())
    rows = bench.results.rows()
    text = render(header, rows, notes(counts, args.skip_peers))
    if not args.profile:
        log("profiling the missed targets once more (cProfile)")
        await infra.open()
        try:
            explained = await explain_misses(bench, rows, args.out / "miss-profiles")
        finally:
            children.kill_all()
            await infra.close()
        if explained:
            text += (
                "\nWhere the cost goes (missed targets, and guard off at c=10):\n\n```\n"
                + explained
                + "\n```\n"
            )
    if args.profile:
        text += "\nPROFILED RUN: timings include pyinstrument's overhead.\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README-table.md").write_text(text)
    payload = {
        "header": header,
        "rows": rows,
        "runs": bench.results.runs,
        "worker_pids": children.worker_pids,
        "notes": notes(counts, args.skip_peers),
    }
    (args.out / "latest.json").write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {args.out / 'latest.json'} and {args.out / 'README-table.md'}")
    # The charts of the docs' performance page, from the same rows (benchmarks/plots.py).
    svgs = write_plots(payload, args.out)
    log(f"wrote {', '.join(p.name for p in svgs)} in {args.out}")
    # A peer that cannot run is a finding (its row says why); ours or the baseline not
    # running is a broken benchmark.
    broken = [r for r in rows if r["median"] is None and r["contender"] in OURS_AND_BASELINES]
    for r in broken:
        log(f"no data: {r['case_label']} / {r['contender_label']}: {r['error']}")
    return 1 if broken else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(amain(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        log("interrupted: the queues and Redis keys of this run were deleted")
        return 130


if __name__ == "__main__":
    sys.exit(main())

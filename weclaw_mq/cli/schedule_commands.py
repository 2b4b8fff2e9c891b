"""``weclaw-mq scheduler MODULE:APP`` fires an app's schedules; ``weclaw-mq schedules ...``
lists them, pauses and resumes them (``weclaw_mq.scheduling``).

The scheduler runs until SIGTERM or SIGINT, then gives its lease up (a standby takes over at
once) and exits 0. Run as many replicas as you like: one fires each tick. It needs Redis
(exit 1 with one line for an app without the Redis task store; 5 when Redis does not answer).
"""

from __future__ import annotations

import asyncio
import json
import signal
from datetime import datetime
from typing import Annotated, Any

import typer

from weclaw_mq.app import App
from weclaw_mq.cli.exit_codes import fail
from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.options import AppPath, LogFormatOption, LogLevel
from weclaw_mq.observability.tracing import LogFormat, configure_logging
from weclaw_mq.scheduling.scheduler import (
    Scheduler,
    ScheduleView,
    describe_schedules,
    pause,
)

schedules_cli = typer.Typer(
    name="schedules",
    help="List an app's schedules (next tick, last outcome), pause and resume them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ScheduleName = Annotated[
    str, typer.Argument(metavar="NAME", help="The schedule's name.", show_default=False)
]
COLUMNS = ("SCHEDULE", "QUEUE", "EVERY", "MISSED", "NEXT TICK", "LAST TICK", "LAST STATUS")


def run_scheduler(
    app_path: AppPath,
    log_level: LogLevel = "INFO",
    log_format: LogFormatOption = "text",
) -> None:
    """Fire the app's schedules, each tick once however many replicas run; SIGTERM stops."""
    fmt: LogFormat = "json" if log_format == "json" else "text"
    configure_logging(log_level, fmt)
    app = load_app(app_path)
    if not app.schedules:
        fail(f"app {app.name!r} has no schedules (app.schedule(...)): nothing to fire")
    asyncio.run(_serve(app))


async def _serve(app: App) -> None:
    scheduler = Scheduler(app)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, scheduler.stop)
    try:
        await scheduler.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await app.close()


def _run(app_path: str, work: Any) -> Any:
    configure_logging("WARNING")
    app = load_app(app_path)

    async def go() -> Any:
        async with app:
            return await work(app)

    return asyncio.run(go())


@schedules_cli.command("list")
def list_schedules(
    app_path: AppPath,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            metavar="",
            help='One JSON document: {"app", "leader", "schedules": [{"name", "queue", '
            '"every", "missed", "paused", "next_tick", "last_tick", "last_task_id", '
            '"last_status", "fired", "skipped"}]}.',
        ),
    ] = False,
) -> None:
    """Every schedule of the app: when it next fires, the last tick and its task's status."""

    async def listing(app: App) -> tuple[str, list[ScheduleView], bool]:
        views, leader = await describe_schedules(app)
        return app.name, views, leader

    app_name, views, leader = _run(app_path, listing)
    if as_json:
        typer.echo(
            json.dumps(
                {"app": app_name, "leader": leader, "schedules": [_document(v) for v in views]}
            )
        )
        return
    if not views:
        typer.echo(f"app {app_name!r} has no schedules")
        return
    rows = [
        (
            v.name + (" (paused)" if v.paused else ""),
            v.queue,
            v.every,
            v.missed,
            _when(v.next_tick),
            _when(v.last_tick),
            v.last_status or "-",
        )
        for v in views
    ]
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    for row in [COLUMNS, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not leader:
        typer.echo("no scheduler holds the lease now: run 'weclaw-mq scheduler MODULE:APP'")


@schedules_cli.command("pause")
def pause_schedule(app_path: AppPath, name: ScheduleName) -> None:
    """Pause a schedule: its ticks are skipped until it is resumed (every replica at once)."""
    _run(app_path, lambda app: pause(app, name, True))
    typer.echo(f"schedule {name} paused")


@schedules_cli.command("resume")
def resume_schedule(app_path: AppPath, name: ScheduleName) -> None:
    """Resume a paused schedule from its next tick (the ticks of the pause are not run)."""
    _run(app_path, lambda app: pause(app, name, False))
    typer.echo(f"schedule {name} resumed")


def _when(moment: datetime | None) -> str:
    return moment.isoformat(timespec="seconds") if moment is not None else "-"


def _document(view: ScheduleView) -> dict[str, Any]:
    return {
        "name": view.name,
        "queue": view.queue,
        "every": view.every,
        "missed": view.missed,
        "paused": view.paused,
        "next_tick": None if view.next_tick is None else view.next_tick.isoformat(),
        "last_tick": None if view.last_tick is None else view.last_tick.isoformat(),
        "last_task_id": view.last_task_id,
        "last_status": view.last_status,
        "fired": view.fired,
        "skipped": view.skipped,
    }

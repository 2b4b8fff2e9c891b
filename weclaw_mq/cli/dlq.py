"""``weclaw-mq dlq ...`` and ``weclaw-mq stats``: thin over ``dlq`` and ``queue_stats``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from .. import headers as h
from ..admin import dlq, dlq_message, queue_stats
from ..app import App
from ..errors import ConfigurationError
from ..naming import dlq_name
from ..tracing import configure_logging
from .failures import fail
from .loading import load_app

T = TypeVar("T")

dlq_cli = typer.Typer(
    name="dlq",
    help="Look at, export, requeue or purge a handler queue's dead letters (QUEUE.dlq).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Queue = Annotated[
    str,
    typer.Argument(help="The handler queue Q (its dead letters are in Q.dlq).", show_default=False),
]
Limit = Annotated[
    int | None, typer.Option("--limit", "-n", min=1, help="At most this many messages.")
]
AppOption = Annotated[
    str | None,
    typer.Option(
        "--app",
        help="MODULE:APP to take settings, handler options and result store from "
        "(default: WECLAW_MQ_* settings only).",
    ),
]


def _run(app_path: str | None, work: Callable[[App], Awaitable[T]]) -> T:
    configure_logging("WARNING")  # our warnings (e.g. Redis down) still reach stderr
    app = load_app(app_path) if app_path else App("weclaw-mq-cli")

    async def go() -> T:
        async with app:
            return await work(app)

    return asyncio.run(go())


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@dlq_cli.command("list")
def list_(queue: Queue, limit: Limit = 100, app_path: AppOption = None) -> None:
    """One line per dead letter (left in the DLQ): task id, reason, error, attempts, time."""
    dead = _run(app_path, lambda app: dlq.inspect(app, queue, limit=limit))
    _table(
        ["TASK_ID", "REASON", "ERROR_TYPE", "ATTEMPTS", "LAST_FAILURE"],
        [
            [
                d.task_id or "-",
                d.reason,
                d.error_type or "-",
                str(d.attempts) if d.attempts is not None else "-",
                _when(d.last_failure_at),
            ]
            for d in dead
        ],
    )
    if limit is not None and len(dead) == limit:
        typer.echo(f"(the first {limit}; there may be more: --limit N)", err=True)


@dlq_cli.command()
def show(
    queue: Queue,
    task_id: Annotated[str, typer.Argument(help="The task id to show.")],
    app_path: AppOption = None,
) -> None:
    """Every field of one dead letter, its headers, body and traceback; exit 1 if absent."""
    dead = _run(app_path, lambda app: dlq.find(app, queue, task_id))
    if dead is None:
        fail(f"no task {task_id} in {dlq_name(queue)}")
    record = dlq_message.export_record(dead)
    headers = record.pop("headers")
    body = record.pop("body")
    record["dead_lettered_by"] = "broker" if dead.by_broker else "worker"
    for key, value in record.items():
        typer.echo(f"{key}: {value if value is not None else '-'}")
    typer.echo("headers:")
    for key, value in sorted(headers.items()):
        if key != h.ERROR_TRACEBACK:
            typer.echo(f"  {key}: {json.dumps(value)}")
    typer.echo(f"body: {body}")
    typer.echo("traceback:")
    typer.echo(dead.traceback.rstrip() if dead.traceback else "  (none)")


@dlq_cli.command()
def requeue(
    queue: Queue,
    limit: Limit = None,
    task_id: Annotated[
        list[str] | None,
        typer.Option("--task-id", "-t", help="Only this task (repeatable). Default: all."),
    ] = None,
    app_path: AppOption = None,
) -> None:
    """Move dead letters back to QUEUE at attempt 1 (publish+confirm, then ack the DLQ copy)."""
    moved = _run(app_path, lambda app: dlq.requeue(app, queue, limit=limit, task_ids=task_id))
    typer.echo(f"moved {moved} message(s) from {dlq_name(queue)} to {queue}")
    if task_id and moved == 0:
        fail(f"none of the task ids is in {dlq_name(queue)}")


@dlq_cli.command()
def purge(
    queue: Queue,
    yes: Annotated[
        bool, typer.Option("--yes", help="Really delete them: purged messages are gone.")
    ] = False,
    app_path: AppOption = None,
) -> None:
    """Delete every dead letter of QUEUE for good (needs --yes)."""
    if not yes:
        fail(
            f"refusing to purge {dlq_name(queue)} without --yes; purged messages cannot be "
            "recovered (save them first with 'weclaw-mq dlq export')"
        )
    removed = _run(app_path, lambda app: dlq.purge(app, queue))
    typer.echo(f"purged {removed} message(s) from {dlq_name(queue)}")


@dlq_cli.command()
def export(
    queue: Queue,
    file: Annotated[Path, typer.Argument(help="JSON lines file to write (overwritten).")],
    limit: Limit = None,
    app_path: AppOption = None,
) -> None:
    """Write the dead letters as JSON lines (left in the DLQ)."""
    written = _run(app_path, lambda app: dlq.export(app, queue, file, limit=limit))
    typer.echo(f"exported {written} message(s) from {dlq_name(queue)} to {file}")


def stats(queue: Queue, app_path: AppOption = None) -> None:
    """Ready messages and consumers of QUEUE, its delay queues and its DLQ."""

    async def look(app: App) -> queue_stats.QueueStats:
        if app_path and queue not in app.handlers:
            known = ", ".join(app.handlers) or "none"
            raise ConfigurationError(f"{app_path} has no handler for {queue!r} (known: {known})")
        delays = queue_stats.handler_retry_delays_ms(app, queue)
        return await queue_stats.stats(app, queue, retry_delays_ms=delays)

    result = _run(app_path, look)
    if not app_path:
        typer.echo(
            "(delay queues as a handler with default retry settings declares them; "
            "pass --app for the handler's own)",
            err=True,
        )
    _table(
        ["QUEUE", "ROLE", "READY", "CONSUMERS"],
        [
            [
                c.name,
                c.role,
                str(c.messages) if c.exists else "absent",
                str(c.consumers) if c.exists else "-",
            ]
            for c in result.all
        ],
    )

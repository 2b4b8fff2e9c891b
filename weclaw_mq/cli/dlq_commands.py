"""``weclaw-mq dlq ...`` and ``weclaw-mq stats``: thin over ``dlq`` (looks, export, import),
``dlq_action.DlqAction`` (requeue, purge: its preview is the ``--dry-run``) and
``queue_stats``."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from weclaw_mq.admin import dlq, dlq_message, queue_stats
from weclaw_mq.admin.dlq_action import DlqAction
from weclaw_mq.admin.dlq_filter import DlqFilter, parse_time
from weclaw_mq.admin.dlq_pass import Progress
from weclaw_mq.app import App
from weclaw_mq.cli.exit_codes import fail
from weclaw_mq.cli.loading import load_app
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.tracing import configure_logging

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
    typer.Argument(
        metavar="QUEUE",
        help="The handler queue Q (its dead letters are in Q.dlq).",
        show_default=False,
    ),
]
Limit = Annotated[
    int | None,
    typer.Option("--limit", "-n", min=1, metavar="N", help="At most this many messages."),
]
TaskIds = Annotated[
    list[str] | None,
    typer.Option("--task-id", "-t", metavar="ID", help="Only this task (repeatable: any of them)."),
]
ErrorTypes = Annotated[
    list[str] | None,
    typer.Option(
        "--error-type",
        "-e",
        metavar="NAME",
        help="Only this stable error name, e.g. RuntimeError, weclaw_mq.Reject (repeatable).",
    ),
]
Reasons = Annotated[
    list[str] | None,
    typer.Option(
        "--reason",
        "-r",
        metavar="REASON",
        help="Only this dead-letter reason, e.g. rejected, retries_exhausted, delivery_limit, "
        "expired, invalid_payload (repeatable).",
    ),
]
Since = Annotated[
    str | None,
    typer.Option(
        "--since",
        metavar="TIME",
        help="Only dead letters that failed at or after TIME: ISO-8601 (UTC unless it has an "
        "offset) or a duration before now (90s, 15m, 2h, 3d, 1w).",
    ),
]
Until = Annotated[
    str | None,
    typer.Option("--until", metavar="TIME", help="Only dead letters that failed before TIME."),
]
DryRun = Annotated[
    bool,
    typer.Option("--dry-run", help="Print what would happen and change nothing."),
]
JsonOutput = Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")]
AppOption = Annotated[
    str | None,
    typer.Option(
        "--app",
        metavar="MODULE:APP",
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


def _time_option(value: str | None, name: str, now: datetime) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_time(value, now=now)
    except ConfigurationError as e:
        raise typer.BadParameter(str(e), param_hint=name) from None


def _filter(
    task_ids: list[str] | None,
    error_types: list[str] | None,
    reasons: list[str] | None,
    since: str | None,
    until: str | None,
) -> DlqFilter:
    """The one place the filter options become a ``DlqFilter``, for every command."""
    now = datetime.now(UTC)
    try:
        return DlqFilter.of(
            task_ids=task_ids,
            error_types=error_types,
            reasons=reasons,
            since=_time_option(since, "--since", now),
            until=_time_option(until, "--until", now),
        )
    except ConfigurationError as e:  # --since after --until
        raise typer.BadParameter(str(e)) from None


# The filter options of every command that selects dead letters, in this order after --limit.
_FILTER_OPTIONS = [
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=kind)
    for name, kind in [
        ("task_id", TaskIds),
        ("error_type", ErrorTypes),
        ("reason", Reasons),
        ("since", Since),
        ("until", Until),
    ]
]


def _filtered(command: Callable[..., None]) -> Callable[..., None]:
    """The command with the filter options (``--task-id`` to ``--until``) after its
    ``limit``, and its keyword ``where`` given the ``DlqFilter`` they make: declared once, for
    every command, and shown in the same place in each one's --help."""
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "where":
            parameters.append(parameter)
        if parameter.name == "limit":
            parameters += _FILTER_OPTIONS

    @functools.wraps(command)
    def run(**options: Any) -> None:
        where = _filter(*(options.pop(option.name) for option in _FILTER_OPTIONS))
        command(**options, where=where)

    # Typer reads a command's parameters from its signature and its annotations.
    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return run


def _dead_letter_table(dead: Sequence[dlq_message.DeadLetter]) -> None:
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


def _matching(where: DlqFilter) -> str:
    return f" matching {where.describe()}" if not where.everything else ""


@dlq_cli.command("list")
@_filtered
def list_(
    queue: Queue,
    limit: Limit = 100,
    as_json: JsonOutput = False,
    app_path: AppOption = None,
    *,
    where: DlqFilter,
) -> None:
    """One line per dead letter (left in the DLQ): task id, reason, error, attempts, time."""
    seen = _run(app_path, lambda app: dlq.look(app, queue, where=where, limit=limit))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "queue": queue,
                    "dlq": dlq_name(queue),
                    "total": seen.total,
                    "matched": seen.matched,
                    "dead_letters": [dlq_message.export_record(d) for d in seen.shown],
                }
            )
        )
        return
    _dead_letter_table(seen.shown)
    if seen.matched > len(seen.shown):
        typer.echo(
            f"(the first {len(seen.shown)} of {seen.matched}{_matching(where)}: --limit N)",
            err=True,
        )


@dlq_cli.command()
def show(
    queue: Queue,
    task_id: Annotated[str, typer.Argument(metavar="TASK_ID", help="The task id to show.")],
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
    typer.echo(f"body: {json.dumps(body) if not isinstance(body, str) else body}")
    typer.echo("traceback:")
    typer.echo(dead.traceback.rstrip() if dead.traceback else "  (none)")


def _rate(value: str | None) -> float | None:
    """``--rate``: ``N/s`` or ``N`` messages per second, N > 0."""
    if value is None:
        return None
    text = value.strip().removesuffix("/s")
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise typer.BadParameter(f"{value!r} is not a rate like 50/s", param_hint="--rate")
    return rate


@contextmanager
def _progress_bar(show: bool | None, what: str) -> Iterator[Progress | None]:
    """A rich progress bar on stderr: by default only when stderr is a terminal (a script or
    a pipe gets only the summary); ``--progress``/``--no-progress`` decide otherwise."""
    if not (sys.stderr.isatty() if show is None else show):
        yield None
        return
    from rich.console import Console  # typer brings rich; only this command needs it
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(what, total=None)

        def step(visited: int, total: int) -> None:
            bar.update(task, completed=visited, total=total)

        yield step


@dlq_cli.command()
@_filtered
def requeue(
    queue: Queue,
    limit: Limit = None,
    rate: Annotated[
        str | None,
        typer.Option("--rate", metavar="N/s", help="At most N messages per second (e.g. 50/s)."),
    ] = None,
    dry_run: DryRun = False,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="A progress bar on stderr (default: only when stderr is a terminal).",
            show_default=False,
        ),
    ] = None,
    app_path: AppOption = None,
    *,
    where: DlqFilter,
) -> None:
    """Move dead letters back to QUEUE at attempt 1 (publish+confirm, then ack the DLQ copy)."""
    action = DlqAction("requeue", queue, where, limit, rate_per_s=_rate(rate))
    source = dlq_name(queue)
    with _progress_bar(progress, f"requeue {source}") as step:
        summary = _run(
            app_path,
            lambda app: (
                action.preview(app, progress=step) if dry_run else action.apply(app, progress=step)
            ),
        )
    left = f"skipped {summary.skipped}, failed {summary.failed}, left {summary.kept}"
    if dry_run:
        _dead_letter_table(summary.selected)
        typer.echo(
            f"dry run: would move {summary.acted} message(s) from {source} to {queue}"
            f"{_matching(where)}; would skip {summary.skipped}, leave {summary.kept}; "
            "nothing changed"
        )
        return
    typer.echo(f"moved {summary.acted} message(s) from {source} to {queue}; {left}")
    if summary.failed:
        fail(f"the broker refused {summary.failed} message(s); they stay in {source}")
    if where.task_ids and summary.acted == 0:
        fail(f"none of the task ids is in {source}")


@dlq_cli.command()
@_filtered
def purge(
    queue: Queue,
    yes: Annotated[
        bool, typer.Option("--yes", help="Really delete them: purged messages are gone.")
    ] = False,
    limit: Limit = None,
    dry_run: DryRun = False,
    app_path: AppOption = None,
    *,
    where: DlqFilter,
) -> None:
    """Delete dead letters of QUEUE for good: all, or those the filters select, at most --limit
    of them, oldest first (needs --yes)."""
    action = DlqAction("purge", queue, where, limit)
    source = dlq_name(queue)
    if dry_run:
        summary = _run(app_path, action.preview)
        _dead_letter_table(summary.selected)
        typer.echo(
            f"dry run: would purge {summary.acted} message(s) from {source}{_matching(where)}; "
            f"would leave {summary.kept}; nothing changed"
        )
        return
    if not yes:
        fail(
            f"refusing to purge {source} without --yes; purged messages cannot be "
            "recovered (save them first with 'weclaw-mq dlq export', or look with --dry-run)"
        )
    done = _run(app_path, action.apply)
    if where.everything and limit is None:  # the broker's purge of the whole queue
        typer.echo(f"purged {done.acted} message(s) from {source}")
        return
    typer.echo(f"purged {done.acted} message(s) from {source}{_matching(where)}; left {done.kept}")


FileOrDash = Annotated[
    str,
    typer.Argument(
        metavar="FILE", help="JSON lines file ('-': stdout for export, stdin for import)."
    ),
]


@dlq_cli.command()
@_filtered
def export(
    queue: Queue,
    file: FileOrDash,
    limit: Limit = None,
    app_path: AppOption = None,
    *,
    where: DlqFilter,
) -> None:
    """Write the dead letters as JSON lines (left in the DLQ); FILE is overwritten."""
    target: Any = sys.stdout if file == "-" else Path(file)
    written = _run(app_path, lambda app: dlq.export(app, queue, target, limit=limit, where=where))
    typer.echo(
        f"exported {written} message(s) from {dlq_name(queue)}{_matching(where)} to "
        f"{'stdout' if file == '-' else file}",
        err=file == "-",  # stdout holds the records
    )


@dlq_cli.command("import")
def import_(queue: Queue, file: FileOrDash, app_path: AppOption = None) -> None:
    """Put the records of an export back into QUEUE.dlq exactly (body, properties, headers).

    Every line is checked before the first publish; each publish is confirmed."""
    if file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read {file}: {getattr(e, 'strerror', None) or e}")
    imported = _run(app_path, lambda app: dlq.import_records(app, queue, lines))
    typer.echo(f"imported {imported} message(s) into {dlq_name(queue)}")


def stats(queue: Queue, as_json: JsonOutput = False, app_path: AppOption = None) -> None:
    """Ready messages and consumers of QUEUE, its lanes and delay queues, and its DLQ.

    With --app, the queues of the app's handler for QUEUE (missing ones shown absent);
    without, those found on the broker by name. Exit 3 if QUEUE does not exist."""

    async def look(app: App) -> queue_stats.QueueStats:
        if not app_path:
            return await queue_stats.discover(app, queue)
        if queue not in app.handlers:
            known = ", ".join(app.handlers) or "none"
            raise ConfigurationError(f"{app_path} has no handler for {queue!r} (known: {known})")
        delays = queue_stats.handler_retry_delays_ms(app, queue)
        return await queue_stats.stats(app, queue, retry_delays_ms=delays)

    result = _run(app_path, look)
    if as_json:
        typer.echo(json.dumps(result.as_json()))
        return
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

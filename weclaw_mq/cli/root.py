"""The typer application and its commands."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated

import typer

from ..admin.health import check_all
from ..app import App
from ..settings import Settings
from ..tracing import LOG_FORMATS, LogFormat, configure_logging
from .failures import ExitCode, fail
from .loading import load_app
from .run_worker import run_worker
from .supervisor import Supervisor, SupervisorError, child_command, parse_processes

cli = typer.Typer(
    name="weclaw-mq",
    help="Crash-proof AI task queues on RabbitMQ.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

AppPath = Annotated[
    str, typer.Argument(help="Where your App lives, as MODULE:ATTRIBUTE (e.g. consumers.demo:app).")
]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


LogLevel = Annotated[
    str,
    typer.Option(
        "--log-level",
        envvar="WECLAW_MQ_LOG_LEVEL",
        callback=_log_level,
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL.",
    ),
]


def _log_format(value: str) -> str:
    fmt = value.strip().lower()
    if fmt not in LOG_FORMATS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_FORMATS)}")
    return fmt


LogFormatOption = Annotated[
    str,
    typer.Option(
        "--log-format",
        envvar="WECLAW_MQ_LOG_FORMAT",
        callback=_log_format,
        metavar="text|json",
        help="text (one line per record, for people) or json (one object per line).",
    ),
]


def _processes(value: str | int) -> int:
    try:  # typer hands the default (an int) to the parser too
        return parse_processes(str(value))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _supervise(
    app_path: str,
    processes: int,
    concurrency: int | None,
    queues: list[str] | None,
    metrics_port: int | None,
    log_level: str,
    log_format: str,
) -> None:
    # Each child reads the same settings; a port from them would be taken by all, so the
    # supervisor hands out port + i itself.
    port = metrics_port if metrics_port is not None else Settings().metrics_port
    command = child_command(
        app_path,
        concurrency=concurrency,
        queues=queues,
        metrics_port=port,
        log_level=log_level,
        log_format=log_format,
    )
    try:
        code = Supervisor(command, processes).run()
    except SupervisorError as e:
        fail(str(e), ExitCode(e.exit_code))
    if code:
        raise typer.Exit(code)


@cli.command()
def worker(
    app_path: AppPath,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            "-c",
            min=1,
            help="Handlers in flight per queue (prefetch is the same). Default: settings.",
        ),
    ] = None,
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", "-q", help="Only consume this queue (repeatable). Default: all."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve Prometheus /metrics here (process i of --processes on this port + i).",
        ),
    ] = None,
    processes: Annotated[
        int,
        typer.Option(
            "--processes",
            "-p",
            parser=_processes,
            metavar="N|auto",
            help="Worker processes under one supervisor ('auto': one per core). Default 1.",
        ),
    ] = 1,
    log_level: LogLevel = "INFO",
    log_format: LogFormatOption = "text",
) -> None:
    """Run a worker: declare queues, consume, ack only after success; SIGTERM stops cleanly."""
    fmt: LogFormat = "json" if log_format == "json" else "text"
    configure_logging(log_level, fmt)
    if processes > 1:
        _supervise(app_path, processes, concurrency, queue, metrics_port, log_level, fmt)
        return
    app = load_app(app_path)
    asyncio.run(
        run_worker(app, concurrency=concurrency, queues=queue or None, metrics_port=metrics_port)
    )


@cli.command()
def declare(app_path: AppPath, log_level: LogLevel = "WARNING") -> None:
    """Declare every queue of the app's handlers (idempotent); prints their names."""
    configure_logging(log_level)
    app = load_app(app_path)
    for name in asyncio.run(app.declare()):
        typer.echo(name)


@cli.command()
def publish(
    queue: Annotated[str, typer.Argument(help="Queue to publish to.")],
    data: Annotated[str, typer.Option("--data", "-d", help="The task as a JSON document.")],
    task_id: Annotated[
        str | None, typer.Option("--task-id", help="Task id (default: a new uuid4).")
    ] = None,
    app_path: Annotated[
        str | None,
        typer.Option("--app", help="MODULE:APP whose handler model validates the payload."),
    ] = None,
) -> None:
    """Publish one task and print its id once the broker confirmed it."""
    configure_logging("WARNING")
    try:
        payload = json.loads(data)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON: {e}", param_hint="--data") from e
    app = load_app(app_path) if app_path else App("weclaw-mq-cli")

    async def send() -> str:
        async with app:
            return await app.publish(queue, payload, task_id=task_id)

    typer.echo(asyncio.run(send()))


@cli.command()
def status(
    task_id: Annotated[str, typer.Argument(help="The id publish returned.")],
    wait_s: Annotated[
        float,
        typer.Option("--wait", min=0, help="Wait up to this many seconds for a final state."),
    ] = 0.0,
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            help="The task's record in this queue (default: its most recently written one).",
        ),
    ] = None,
) -> None:
    """Print a task's status (and result) as JSON; exit 1 if the task is unknown."""
    configure_logging("WARNING")

    async def read() -> str | None:
        async with App("weclaw-mq-cli") as app:
            state = (
                await app.result(task_id, queue=queue, timeout_s=wait_s)
                if wait_s > 0
                else await app.status(task_id, queue=queue)
            )
            return state.model_dump_json(indent=2) if state is not None else None

    text = asyncio.run(read())
    if text is None:
        fail(f"no status recorded for task {task_id}")
    typer.echo(text)


@cli.command()
def health() -> None:
    """Check the broker and Redis: exit 0 when both answer, else one line per failing part."""
    configure_logging("CRITICAL")  # the verdict lines below say everything
    parts = asyncio.run(check_all(Settings()))
    failing = [p for p in parts if not p.ok]
    for p in parts:
        if p.ok:
            typer.echo(f"{p.part}: ok ({p.detail})")
    for p in failing:
        typer.echo(f"{p.part}: FAILED {p.detail}", err=True)
    if failing:
        raise typer.Exit(1)


from .dlq import dlq_cli, stats  # noqa: E402  (kept beside its registration)

cli.add_typer(dlq_cli, name="dlq")
cli.command("stats")(stats)

from .outbox import outbox_cli  # noqa: E402  (kept beside its registration)

cli.add_typer(outbox_cli, name="outbox")

from .cancel import cancel  # noqa: E402  (kept beside its registration)

cli.command("cancel")(cancel)

from .permissions import permissions  # noqa: E402

cli.command("permissions")(permissions)

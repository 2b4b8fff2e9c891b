"""The typer application and its commands."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated

import typer

from weclaw_mq.admin.migrate import MigrateSummary
from weclaw_mq.admin.migrate import migrate as run_migrate
from weclaw_mq.app import App
from weclaw_mq.cli.exit_codes import ExitCode, classify, fail, report, where_of
from weclaw_mq.cli.loading import load_app, split_app_path
from weclaw_mq.cli.options import AppPath, LogFormatOption, LogLevel
from weclaw_mq.cli.publish_command import publish
from weclaw_mq.cli.reloader import (
    Reloader,
    child_command,
    require_watchfiles,
    stop_bound_s,
    watched_dirs,
)
from weclaw_mq.cli.run_worker import preload, run_worker
from weclaw_mq.cli.supervisor import Supervisor, SupervisorError, forking, parse_processes
from weclaw_mq.observability.tracing import LogFormat, configure_logging
from weclaw_mq.settings import Settings
from weclaw_mq.wire.broker_load import BROKER_LOAD_UNREADABLE, read_broker_load
from weclaw_mq.worker import event_loop
from weclaw_mq.worker.event_loop import EVENT_LOOPS, EventLoopName

cli = typer.Typer(
    name="weclaw-mq",
    help="Crash-proof AI task queues on RabbitMQ.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"weclaw-mq {version('weclaw_mq')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            fail("weclaw_mq is not installed (no package metadata): pip install -e .")
        raise typer.Exit()


@cli.callback()
def root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            metavar="",
            help="Print the installed weclaw_mq version and exit.",
        ),
    ] = False,
) -> None:
    """Crash-proof AI task queues on RabbitMQ."""


def _event_loop(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.strip().lower()
    if name not in EVENT_LOOPS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(EVENT_LOOPS)}")
    return name


def _processes(value: str | int) -> int:
    try:  # typer hands the default (an int) to the parser too
        return parse_processes(str(value))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _supervise(
    app: App,
    processes: int,
    concurrency: int | None,
    queues: list[str] | None,
    metrics_port: int | None,
    loop: EventLoopName,
    schedules: bool | None,
) -> None:
    # Each child reads the same settings; a port from them would be taken by all, so the
    # supervisor hands out port + i itself.
    port = metrics_port if metrics_port is not None else app.settings.metrics_port
    preload(app, loop=loop, metrics=port is not None)

    def child(index: int) -> int:
        """One forked worker process: runs as ``--processes 1`` does, exits as it would."""
        try:
            main = run_worker(
                app,
                concurrency=concurrency,
                queues=queues,
                metrics_port=None if port is None else port + index,
                # One child reads the broker's load: N Erlang CLIs at once would cost N seconds.
                broker_load_check=None if index == 0 else False,
                schedules=schedules,
            )
            event_loop.run(main, loop)
        except KeyboardInterrupt:
            return ExitCode.INTERRUPTED
        except Exception as e:  # the CLI's one boundary, as in weclaw_mq.cli.main
            code, message = classify(e)
            report(message, where_of(e))
            return code
        return ExitCode.OK

    try:
        code = Supervisor(forking(child), processes).run()
    except SupervisorError as e:
        fail(str(e), ExitCode(e.exit_code))
    if code:
        raise typer.Exit(code)


# The development reloader's options (weclaw_mq.cli.reloader).
ReloadOption = Annotated[
    bool,
    typer.Option(
        "--reload",
        metavar="",
        help="For development: run the worker in a child process and restart it, "
        "gracefully, when a *.py file under the watched folders changes (needs the "
        "'reload' extra: watchfiles). Not with --processes.",
    ),
]
ReloadDirsOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--reload-dir",
        metavar="DIR",
        exists=True,
        file_okay=False,
        help="With --reload: watch this folder (repeatable). Default: the current one "
        "and the app's package's.",
    ),
]

# The worker's parameters its reloader's child does not take: the reloader's own, and
# --processes (refused with --reload).
_RELOADER_ONLY = frozenset({"reload", "reload_dirs", "processes"})


def _child_args(ctx: typer.Context) -> list[str]:
    """The worker command's arguments as parsed, less the reloader's: its child's command."""
    args: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if param.name in _RELOADER_ONLY or value is None:
            continue
        if param.param_type_name == "argument":
            args.append(str(value))
            continue
        option = max(param.opts, key=len)
        if isinstance(value, bool):
            args += [option] if value else list(param.secondary_opts[:1])
            continue
        for one in value if isinstance(value, (list, tuple)) else [value]:
            args += [option, str(one)]
    return args


def _reload(ctx: typer.Context, app_path: str, processes: int, dirs: list[Path]) -> None:
    if processes > 1:
        fail(
            f"--reload is for development and runs one worker process: not with "
            f"--processes {processes}",
            ExitCode.USAGE,
        )
    module_name, _ = split_app_path(app_path)
    require_watchfiles()
    reloader = Reloader(
        child_command(_child_args(ctx)),
        watched_dirs(module_name, dirs, Path.cwd()),
        stop_bound_s=stop_bound_s(Settings().shutdown_grace_s),
    )
    code = reloader.run()
    if code:
        raise typer.Exit(code)


@cli.command()
def worker(
    ctx: typer.Context,
    app_path: AppPath,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            "-c",
            min=1,
            metavar="N",
            help="Handlers in flight per queue (prefetch is the same). Default: settings.",
        ),
    ] = None,
    queue: Annotated[
        list[str] | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="QUEUE",
            help="Only consume this queue (repeatable). Default: all.",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            metavar="PORT",
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
            show_default=False,
            help="Worker processes under one supervisor ('auto': one per core). Default 1.",
        ),
    ] = 1,
    loop: Annotated[
        str | None,
        typer.Option(
            "--loop",
            callback=_event_loop,
            metavar="asyncio|uvloop",
            show_default=False,
            help="The event loop (uvloop needs the package's uvloop extra). "
            "Default: WECLAW_MQ_EVENT_LOOP, else asyncio.",
        ),
    ] = None,
    reload: ReloadOption = False,
    reload_dirs: ReloadDirsOption = None,
    schedules: Annotated[
        bool | None,
        typer.Option(
            "--schedules/--no-schedules",
            show_default=False,
            help="Also run the app's scheduler (every replica competes for its lease; one "
            "fires each tick). Default: WECLAW_MQ_SCHEDULES_IN_WORKER, else off.",
        ),
    ] = None,
    log_level: LogLevel = "INFO",
    log_format: LogFormatOption = "text",
) -> None:
    """Run a worker: declare queues, consume, ack only after success; SIGTERM stops cleanly."""
    if reload_dirs and not reload:
        fail("--reload-dir watches folders for --reload: add --reload", ExitCode.USAGE)
    fmt: LogFormat = "json" if log_format == "json" else "text"
    configure_logging(log_level, fmt)
    if reload:
        _reload(ctx, app_path, processes, reload_dirs or [])
        return
    _work(load_app(app_path), processes, concurrency, queue or None, metrics_port, loop, schedules)


def _work(
    app: App,
    processes: int,
    concurrency: int | None,
    queues: list[str] | None,
    metrics_port: int | None,
    loop: str | None,
    schedules: bool | None,
) -> None:
    """Run the app's worker in this process, or ``processes`` of them under a supervisor."""
    loop_name: EventLoopName = (
        "uvloop" if (loop or app.settings.event_loop) == "uvloop" else "asyncio"
    )
    if processes > 1:
        _supervise(app, processes, concurrency, queues, metrics_port, loop_name, schedules)
        return
    main = run_worker(
        app,
        concurrency=concurrency,
        queues=queues,
        metrics_port=metrics_port,
        schedules=schedules,
    )
    event_loop.run(main, loop_name)


@cli.command()
def declare(app_path: AppPath, log_level: LogLevel = "WARNING") -> None:
    """Declare every queue of the app's handlers (idempotent); prints their names, then (on
    stderr) how many, and what AMQP can say of the broker's load."""
    configure_logging(log_level)
    app = load_app(app_path)
    declared = asyncio.run(app.declare())
    for name in (*declared.shared, *declared):
        typer.echo(name)
    total = len(declared.shared) + len(declared)
    typer.echo(
        f"declared {total} queues: {len(declared)} for {len(app.handlers)} handler(s), "
        f"{len(declared.shared)} shared by the vhost (the delay ladder, the parking queue)",
        err=True,
    )
    load = read_broker_load(app.settings.amqp_urls()[0])
    typer.echo(BROKER_LOAD_UNREADABLE if load is None else load.summary(), err=True)
    if load is not None and (warning := load.warning()) is not None:
        typer.echo(warning, err=True)


@cli.command()
def migrate(app_path: AppPath, log_level: LogLevel = "WARNING") -> None:
    """Delete the queues an older version left for the app's handlers (per-handler delay
    queues, unused lanes) once empty; says what it deleted, moved and kept, and why."""
    configure_logging(log_level)
    app = load_app(app_path)

    async def go() -> MigrateSummary:
        async with app:
            return await run_migrate(app)

    summary = asyncio.run(go())
    for lane, moved in summary.moved.items():
        typer.echo(f"moved {moved} task(s) from {lane} to its handler queue")
    for name in summary.deleted:
        typer.echo(f"deleted {name}")
    for kept in summary.kept:
        typer.echo(f"kept {kept.name} ({kept.messages} ready): {kept.why}")
    if not (summary.deleted or summary.kept or summary.moved):
        typer.echo("nothing to migrate: no queue of an older version found")


cli.command("publish")(publish)


@cli.command()
def status(
    task_id: Annotated[str, typer.Argument(metavar="TASK_ID", help="The id publish returned.")],
    wait_s: Annotated[
        float,
        typer.Option(
            "--wait",
            min=0,
            metavar="SECONDS",
            show_default=False,
            help="Wait up to this many seconds for a final state. Default: do not wait.",
        ),
    ] = 0.0,
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="QUEUE",
            help="The task's record in this queue (default: its most recently written one).",
        ),
    ] = None,
) -> None:
    """Print a task's status (and result) as JSON, with its memoized steps (``ctx.step``)
    under "steps" when it recorded any; exit 1 if the task is unknown."""
    configure_logging("WARNING")

    async def read() -> str | None:
        async with App("weclaw-mq-cli") as app:
            state = (
                await app.result(task_id, queue=queue, timeout_s=wait_s)
                if wait_s > 0
                else await app.status(task_id, queue=queue)
            )
            if state is None:
                return None
            steps = await app.steps(task_id, queue=state.queue)
            if not steps:
                return state.model_dump_json(indent=2)
            shown = json.loads(state.model_dump_json())
            shown["steps"] = [s.to_dict() for s in steps]
            return json.dumps(shown, indent=2, ensure_ascii=False)

    text = asyncio.run(read())
    if text is None:
        fail(f"no status recorded for task {task_id}")
    typer.echo(text)


@cli.command()
def health(
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            metavar="",
            help='One JSON document on stdout: {"ok": ..., "parts": [{"part", "ok", '
            '"detail"}, ...]}; the exit code is the same.',
        ),
    ] = False,
) -> None:
    """Check the broker and Redis: exit 0 when both answer, else one line per failing part."""
    from weclaw_mq.admin.dependency_checks import (
        check_all,  # not on a worker's path (``weclaw-mq worker``)
    )

    configure_logging("CRITICAL")  # the verdict lines below say everything
    parts = asyncio.run(check_all(Settings()))
    failing = [p for p in parts if not p.ok]
    if as_json:
        document = {"ok": not failing, "parts": [dataclasses.asdict(p) for p in parts]}
        typer.echo(json.dumps(document))
        raise typer.Exit(1 if failing else 0)
    for p in parts:
        if p.ok:
            typer.echo(f"{p.part}: ok ({p.detail})")
    for p in failing:
        typer.echo(f"{p.part}: FAILED {p.detail}", err=True)
    if failing:
        raise typer.Exit(1)


from weclaw_mq.cli.dlq_commands import dlq_cli, stats  # noqa: E402  (kept beside its registration)

cli.add_typer(dlq_cli, name="dlq")
cli.command("stats")(stats)

from weclaw_mq.cli.outbox_commands import outbox_cli  # noqa: E402  (kept beside its registration)

cli.add_typer(outbox_cli, name="outbox")

from weclaw_mq.cli.cancel_command import cancel  # noqa: E402  (kept beside its registration)

cli.command("cancel")(cancel)

from weclaw_mq.cli.permissions_command import permissions  # noqa: E402

cli.command("permissions")(permissions)

from weclaw_mq.cli.asyncapi_command import asyncapi  # noqa: E402

cli.command("asyncapi")(asyncapi)

from weclaw_mq.cli.inspect_command import inspect_workers  # noqa: E402

cli.command("inspect")(inspect_workers)

from weclaw_mq.cli.costs_command import costs  # noqa: E402

cli.command("costs")(costs)

from weclaw_mq.cli.schedule_commands import run_scheduler, schedules_cli  # noqa: E402

cli.command("scheduler")(run_scheduler)
cli.add_typer(schedules_cli, name="schedules")
from weclaw_mq.cli.console_command import console  # noqa: E402

cli.command("console")(console)

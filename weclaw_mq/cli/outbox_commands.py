"""``weclaw-mq outbox status`` and ``weclaw-mq outbox relay``: the local outbox from outside
the producer (see weclaw_mq.outbox)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from weclaw_mq.cli.options import LogFormatOption, LogLevel
from weclaw_mq.errors import ConfigurationError, OutboxUnusableError
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.observability.tracing import configure_logging
from weclaw_mq.settings import Settings
from weclaw_mq.state import open_store

if TYPE_CHECKING:  # the outbox (sqlite3) loads only when an outbox command runs
    from weclaw_mq.outbox import Outbox
    from weclaw_mq.outbox.store import RelayStore

log = logging.getLogger("weclaw_mq.outbox")

outbox_cli = typer.Typer(
    name="outbox",
    help="The outbox (a local SQLite file, WECLAW_MQ_OUTBOX_PATH, or a PostgreSQL table, "
    "WECLAW_MQ_OUTBOX_POSTGRES_URL): its state, its table, and a standalone relay.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

PathOption = Annotated[
    str | None,
    typer.Option(
        "--path", metavar="FILE", help="The outbox file (default: WECLAW_MQ_OUTBOX_PATH)."
    ),
]


PostgresOption = Annotated[
    str | None,
    typer.Option(
        "--postgres",
        metavar="URL",
        help="The PostgreSQL outbox's database (default: WECLAW_MQ_OUTBOX_POSTGRES_URL).",
    ),
]


def _settings(path: str | None) -> Settings:
    settings = Settings()
    path = path or settings.outbox_path
    if not path:
        raise ConfigurationError(
            "no outbox: pass --path (or set WECLAW_MQ_OUTBOX_PATH) for a SQLite file, or "
            "--postgres (WECLAW_MQ_OUTBOX_POSTGRES_URL) for a PostgreSQL table"
        )
    return settings.model_copy(update={"outbox_path": path})


def _postgres_url(given: str | None, settings: Settings) -> str | None:
    if given:
        return given
    url = settings.outbox_postgres_url
    return None if url is None else url.get_secret_value()


async def _open_store(settings: Settings, postgres: str | None) -> RelayStore:
    if postgres is not None:
        from weclaw_mq.outbox.postgres import PostgresOutbox

        return await PostgresOutbox.open(postgres)
    return await _open(settings)


@outbox_cli.command()
def migrate(postgres: PostgresOption = None) -> None:
    """Create the PostgreSQL outbox's table, index and NOTIFY trigger (safe to run again)."""
    configure_logging("WARNING")
    url = _postgres_url(postgres, Settings())
    if url is None:
        raise ConfigurationError(
            "no database: pass --postgres URL or set WECLAW_MQ_OUTBOX_POSTGRES_URL"
        )
    from weclaw_mq.outbox.postgres import migrate as create_table

    asyncio.run(create_table(url))
    typer.echo("the weclaw_outbox table is ready")


async def _open(settings: Settings) -> Outbox:
    # No bounds: they are the producers' (App) to set; a relay or a look leaves them.
    assert settings.outbox_path is not None
    from weclaw_mq.outbox import Outbox

    return await Outbox.open(settings.outbox_path)


@outbox_cli.command()
def status(
    path: PathOption = None,
    postgres: PostgresOption = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object.")] = False,
) -> None:
    """Rows waiting, the oldest one's age, the file's size, rows whose last send failed."""
    configure_logging("WARNING")
    pg = _postgres_url(postgres, Settings()) if not path else None
    if pg is not None:
        _echo_status(asyncio.run(_postgres_status(pg)), as_json)
        return
    settings = _settings(path)
    # A look must not create what it looks at: opening a missing path would make an empty
    # outbox there and report 0 rows, so a mistyped path would read as "nothing waiting".
    # (A missing folder is left to Outbox.open, whose error names it.)
    assert settings.outbox_path is not None
    where = Path(settings.outbox_path)
    if where.parent.is_dir() and not where.exists():
        raise OutboxUnusableError(
            f"no outbox file at {settings.outbox_path} (a producer creates it when it opens"
            " its outbox): check --path or WECLAW_MQ_OUTBOX_PATH"
        )

    async def read() -> dict[str, object]:
        outbox = await _open(settings)
        try:
            stats = await outbox.stats()
        finally:
            await outbox.close()
        return {"path": str(outbox.path), **{k: getattr(stats, k) for k in stats.__slots__}}

    _echo_status(asyncio.run(read()), as_json)


async def _postgres_status(url: str) -> dict[str, object]:
    from weclaw_mq.outbox.postgres import PostgresOutbox

    outbox = await PostgresOutbox.open(url)
    try:
        stats = await outbox.stats()
    finally:
        await outbox.close()
    return {"path": "postgresql: weclaw_outbox", **{k: getattr(stats, k) for k in stats.__slots__}}


def _echo_status(info: dict[str, object], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(info))
        return
    age = info["oldest_age_s"]
    typer.echo(f"outbox: {info['path']}")
    # A bound of 0: the PostgreSQL table has none of ours (its database bounds it).
    typer.echo(f"rows: {info['rows']} (bound {info['max_rows'] or 'none'})")
    typer.echo(
        f"bytes: {info['bytes']} (bound {info['max_bytes'] or 'none'}); file {info['file_bytes']}"
    )
    typer.echo(f"oldest: {'-' if age is None else f'{age:.1f} s'}")
    typer.echo(f"being sent now: {info['claimed']}")
    if info["failing"]:
        typer.echo(f"last send failed: {info['failing']} rows (e.g. {info['last_error']})")


@outbox_cli.command()
def relay(
    path: PathOption = None,
    postgres: PostgresOption = None,
    once: Annotated[
        bool, typer.Option("--once", metavar="", help="Drain what is there now, then exit.")
    ] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            metavar="PORT",
            help="Serve Prometheus /metrics here.",
        ),
    ] = None,
    log_level: LogLevel = "INFO",
    log_format: LogFormatOption = "text",
) -> None:
    """Send the outbox's rows to the broker (oldest first, each deleted after its confirm);
    runs until SIGTERM or Ctrl-C. Several relays may share a file or a table: rows are
    claimed. With --postgres, each COMMIT of new rows wakes it (LISTEN/NOTIFY)."""
    configure_logging(log_level, "json" if log_format == "json" else "text")
    pg = _postgres_url(postgres, Settings()) if not path else None
    settings = _settings(path) if pg is None else Settings()
    metrics = Metrics()
    if metrics_port is not None:
        metrics.serve(metrics_port, settings.metrics_addr)

    async def run() -> int:
        from weclaw_mq.outbox.relay import Relay

        outbox = await _open_store(settings, pg)
        store = open_store(settings) if settings.results_enabled else None
        relay = Relay(outbox, settings, metrics, store=store)
        try:
            if once:
                return await relay.drain()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            if pg is not None:
                from weclaw_mq.outbox.postgres import run_relay

                await run_relay(relay, pg, stop)
            else:
                await relay.run(stop)
            return relay.sent
        finally:
            await relay.close()
            if store is not None:
                await store.close()
            await outbox.close()

    sent = asyncio.run(run())
    typer.echo(f"relayed {sent} task(s)")

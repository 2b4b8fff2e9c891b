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

log = logging.getLogger("weclaw_mq.outbox")

outbox_cli = typer.Typer(
    name="outbox",
    help="The local outbox (WECLAW_MQ_OUTBOX_PATH): its state, and a standalone relay.",
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


def _settings(path: str | None) -> Settings:
    settings = Settings()
    path = path or settings.outbox_path
    if not path:
        raise ConfigurationError("no outbox file: pass --path or set WECLAW_MQ_OUTBOX_PATH")
    return settings.model_copy(update={"outbox_path": path})


async def _open(settings: Settings) -> Outbox:
    # No bounds: they are the producers' (App) to set; a relay or a look leaves them.
    assert settings.outbox_path is not None
    from weclaw_mq.outbox import Outbox

    return await Outbox.open(settings.outbox_path)


@outbox_cli.command()
def status(
    path: PathOption = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object.")] = False,
) -> None:
    """Rows waiting, the oldest one's age, the file's size, rows whose last send failed."""
    configure_logging("WARNING")
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

    info = asyncio.run(read())
    if as_json:
        typer.echo(json.dumps(info))
        return
    age = info["oldest_age_s"]
    typer.echo(f"outbox: {info['path']}")
    typer.echo(f"rows: {info['rows']} (bound {info['max_rows']})")
    typer.echo(f"bytes: {info['bytes']} (bound {info['max_bytes']}); file {info['file_bytes']}")
    typer.echo(f"oldest: {'-' if age is None else f'{age:.1f} s'}")
    typer.echo(f"being sent now: {info['claimed']}")
    if info["failing"]:
        typer.echo(f"last send failed: {info['failing']} rows (e.g. {info['last_error']})")


@outbox_cli.command()
def relay(
    path: PathOption = None,
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
    runs until SIGTERM or Ctrl-C. Several relays may share a file: rows are claimed."""
    configure_logging(log_level, "json" if log_format == "json" else "text")
    settings = _settings(path)
    metrics = Metrics()
    if metrics_port is not None:
        metrics.serve(metrics_port, settings.metrics_addr)

    async def run() -> int:
        from weclaw_mq.outbox.relay import Relay

        outbox = await _open(settings)
        store = open_store(settings) if settings.results_enabled else None
        relay = Relay(outbox, settings, metrics, store=store)
        try:
            if once:
                return await relay.drain()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await relay.run(stop)
            return relay.sent
        finally:
            await relay.close()
            if store is not None:
                await store.close()
            await outbox.close()

    sent = asyncio.run(run())
    typer.echo(f"relayed {sent} task(s)")

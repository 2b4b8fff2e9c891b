"""``weclaw-mq publish QUEUE --data JSON|@FILE|-``: thin over ``App.publish``.

The payload is checked before anything is sent: it must be JSON, and with ``--app`` it must
pass the queue's handler model (``App.prepare``; a refusal is exit 2, see ``cli.failures``).
A ``--task-id`` must follow the rule every front door shares (``weclaw_mq.task_ids``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..app import App
from ..errors import ConfigurationError
from ..task_ids import validate_task_id
from ..tracing import configure_logging
from .loading import load_app

STDIN = "-"
FROM_FILE = "@"


def _task_id(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_task_id(value)
    except ConfigurationError as e:
        raise typer.BadParameter(str(e)) from None


def read_data(data: str) -> Any:
    """The payload ``--data`` names: a JSON document, ``@FILE`` holding one, or ``-`` (stdin)."""
    if data == STDIN:
        text, source = sys.stdin.read(), "stdin"
    elif data.startswith(FROM_FILE):
        path = Path(data[len(FROM_FILE) :])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise typer.BadParameter(f"cannot read {path}: {reason}", param_hint="--data") from e
        source = str(path)
    else:
        text, source = data, ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f" in {source}" if source else ""
        raise typer.BadParameter(f"not valid JSON{where}: {e}", param_hint="--data") from e


def publish(
    queue: Annotated[str, typer.Argument(metavar="QUEUE", help="Queue to publish to.")],
    data: Annotated[
        str,
        typer.Option(
            "--data",
            "-d",
            metavar="JSON|@FILE|-",
            help="The task: a JSON document, @FILE to read it from a file, - from stdin.",
        ),
    ],
    task_id: Annotated[
        str | None,
        typer.Option(
            "--task-id",
            metavar="ID",
            callback=_task_id,
            help="Task id: 1 to 128 of letters, digits and '_.:-' (default: a new uuid4).",
        ),
    ] = None,
    app_path: Annotated[
        str | None,
        typer.Option(
            "--app",
            metavar="MODULE:APP",
            help="Check the task against this App's handler model for QUEUE before sending.",
        ),
    ] = None,
) -> None:
    """Publish one task and print its id once the broker confirmed it."""
    configure_logging("WARNING")
    payload = read_data(data)
    if app_path is None:
        app = App("weclaw-mq-cli")
    else:
        app = load_app(app_path)
        if queue not in app.handlers:
            known = ", ".join(app.handlers) or "none"
            raise ConfigurationError(f"{app_path} has no handler for {queue!r} (known: {known})")

    async def send() -> str:
        async with app:
            return await app.publish(queue, payload, task_id=task_id)

    typer.echo(asyncio.run(send()))

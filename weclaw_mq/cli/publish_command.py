"""``weclaw-mq publish QUEUE --data JSON|@FILE|-``: thin over ``App.publish``.

The payload is checked before anything is sent: it must be JSON, and with ``--app`` it must
pass the queue's handler model (``App.prepare``; a refusal is exit 2, see ``cli.exit_codes``).
A ``--task-id`` must follow the rule every front door shares (``weclaw_mq.contract.task_ids``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from weclaw_mq.app import App
from weclaw_mq.cli.loading import load_app
from weclaw_mq.contract.task_ids import validate_task_id
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.tracing import configure_logging

STDIN = "-"
FROM_FILE = "@"


def _task_id(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_task_id(value)
    except ConfigurationError as e:
        raise typer.BadParameter(str(e)) from None


def read_data(data: str, *, limit_bytes: int) -> Any:
    """The payload ``--data`` names: a JSON document, ``@FILE`` holding one, or ``-`` (stdin).

    A file or stdin is read up to ``limit_bytes`` + 1 only: a task over the message size
    limit is refused, so ``@/dev/urandom`` costs one limit of memory, not all of it."""
    if data == STDIN:
        raw, source = sys.stdin.buffer.read(limit_bytes + 1), "stdin"
    elif data.startswith(FROM_FILE):
        path = Path(data[len(FROM_FILE) :])
        try:
            with path.open("rb") as f:
                raw = f.read(limit_bytes + 1)
        except OSError as e:
            raise typer.BadParameter(
                f"cannot read {path}: {e.strerror or e}", param_hint="--data"
            ) from e
        source = str(path)
    else:
        return _json(data, "")
    if len(raw) > limit_bytes:
        raise typer.BadParameter(
            f"{source} holds more than {limit_bytes} bytes, the message size limit "
            "(WECLAW_MQ_MAX_MESSAGE_BYTES); nothing was sent",
            param_hint="--data",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise typer.BadParameter(f"cannot read {source}: {e}", param_hint="--data") from e
    return _json(text, source)


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not JSON (RFC 8259); the encoder would send them as null.
    raise ValueError(f"{name} is not a JSON value")


def _int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        raise ValueError(f"a number of {len(digits)} digits (Python reads at most {limit})")
    return int(digits)


def _json(text: str, source: str) -> Any:
    where = f" in {source}" if source else ""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_int=_int)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON{where}: {e}", param_hint="--data") from e
    except ValueError as e:  # a number past Python's digit limit, NaN, Infinity
        raise typer.BadParameter(f"cannot take this JSON{where}: {e}", param_hint="--data") from e


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
    if app_path is None:
        app = App("weclaw-mq-cli")
    else:
        app = load_app(app_path)
        if queue not in app.handlers:
            known = ", ".join(app.handlers) or "none"
            raise ConfigurationError(f"{app_path} has no handler for {queue!r} (known: {known})")
    payload = read_data(data, limit_bytes=app.settings.max_message_bytes)

    async def send() -> str:
        async with app:
            return await app.publish(queue, payload, task_id=task_id)

    typer.echo(asyncio.run(send()))

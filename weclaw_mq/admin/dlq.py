"""Operating a handler's dead-letter queue ``Q.dlq``: look, export, import, shovel back, purge.

What a dead letter says is read by ``dlq_message``, which of them a command acts on is decided
by ``dlq_filter``; the pass over the queue is ``dlq_pass``, and a requeue or a purge is one
``dlq_action.DlqAction`` (its preview and its apply select the same messages). Every move is
"publish with confirm, then ack the DLQ copy", like every other hop: a crash in between
duplicates, never loses. That holds for looking too: a look rotates the DLQ (see
``dlq_pass.Pass``) rather than taking messages and handing them back.
"""

from __future__ import annotations

import binascii
import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yarl
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_action import DlqAction, Outcome
from weclaw_mq.admin.dlq_filter import EVERYTHING, DlqFilter
from weclaw_mq.admin.dlq_message import (
    DeadLetter,
    encoded_properties,
    export_record,
    record_body,
    record_properties,
)
from weclaw_mq.admin.dlq_pass import pass_over, read, trimmed
from weclaw_mq.app import App
from weclaw_mq.errors import PayloadError

# aio-pika logs in as guest when the URL names no user.
DEFAULT_USER = "guest"


@dataclass(frozen=True)
class Looked:
    """What one look at ``Q.dlq`` saw: up to ``limit`` matching dead letters, in queue order,
    and how many matched and were there in all."""

    shown: list[DeadLetter]
    matched: int
    total: int


async def look(
    app: App,
    queue: str,
    *,
    where: DlqFilter = EVERYTHING,
    limit: int | None = 100,
    body_max: int | None = None,
) -> Looked:
    """The dead letters of ``Q.dlq`` that ``where`` selects (up to ``limit`` of them; None:
    all), every message left in the DLQ unchanged and in order. With ``body_max``, each
    shown body longer than that keeps only its first ``body_max`` bytes (``body_size`` says
    how long it is), so a look holds at most ``limit`` times that much of the bodies."""
    shown: list[DeadLetter] = []
    matched = total = 0
    async with pass_over(app, queue, "inspect") as dlq:
        while (message := await dlq.next()) is not None:
            total += 1
            dead = read(message)
            if where.matches(dead):
                matched += 1
                if limit is None or len(shown) < limit:
                    shown.append(trimmed(dead, body_max))
            await dlq.keep(message)
    return Looked(shown, matched, total)


async def inspect(
    app: App, queue: str, *, limit: int | None = 100, where: DlqFilter = EVERYTHING
) -> list[DeadLetter]:
    """Up to ``limit`` messages of ``Q.dlq`` (None: all), left in the DLQ unchanged."""
    return (await look(app, queue, where=where, limit=limit)).shown


async def find(app: App, queue: str, task_id: str) -> DeadLetter | None:
    """The first message of ``Q.dlq`` with this task id, left in the DLQ; None if none."""
    found: DeadLetter | None = None
    async with pass_over(app, queue, "show") as dlq:
        while (message := await dlq.next()) is not None:
            if found is None and message.header.properties.message_id == task_id:
                found = read(message)
            await dlq.keep(message)
    return found


async def export(
    app: App,
    queue: str,
    path: str | Path | TextIO,
    *,
    limit: int | None = None,
    where: DlqFilter = EVERYTHING,
) -> int:
    """Write the dead letters ``where`` selects as JSON lines (``export_record``, with the
    exact AMQP properties ``dlq import`` restores) to ``path`` (a file name, or an open text
    stream such as stdout), left in the DLQ; how many were written."""
    written = 0
    async with pass_over(app, queue, "export") as dlq:
        with _opened(path) as out:
            while (message := await dlq.next()) is not None:
                dead = read(message)
                if where.matches(dead) and (limit is None or written < limit):
                    raw = encoded_properties(message.header.properties)
                    out.write(json.dumps(export_record(dead, raw)) + "\n")
                    written += 1
                await dlq.keep(message)
    return written


@contextlib.contextmanager
def _opened(path: str | Path | TextIO) -> Iterator[TextIO]:
    # Entered once the DLQ is known to exist, so a typo never truncates a file. Blocking
    # writes are fine here: small buffered lines to a local file, from an ops command.
    if not isinstance(path, (str, Path)):
        yield path
        path.flush()
        return
    with Path(path).open("w", encoding="utf-8") as out:
        yield out


async def import_records(app: App, queue: str, lines: Iterable[str]) -> int:
    """Publish each record of an export (JSON lines) to ``Q.dlq`` with a confirm, body and
    properties byte for byte as exported; how many. Every line is read and checked before the
    first publish: a damaged file publishes nothing (``PayloadError`` naming the line)."""
    # The broker refuses a user_id that is not the user this import connects as.
    user = yarl.URL(app.settings.amqp_urls()[0]).user or DEFAULT_USER
    messages = [_record_message(n, line, user) for n, line in enumerate(lines, 1) if line.strip()]
    async with pass_over(app, queue, "import") as dlq:
        dlq.budget = 0  # nothing is taken: the pass only lends its confirmed channel
        for body, properties in messages:
            await dlq.publish(dlq.dlq, body, properties)
    return len(messages)


def _record_message(line_number: int, line: str, user: str) -> tuple[bytes, Basic.Properties]:
    try:
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        return record_body(record), record_properties(record, user=user)
    except RecursionError:
        raise PayloadError(
            f"line {line_number} is nested too deeply to be a 'weclaw-mq dlq export' record; "
            "nothing imported"
        ) from None
    except (ValueError, binascii.Error) as e:
        raise PayloadError(
            f"line {line_number} is not a 'weclaw-mq dlq export' record: {e}; nothing imported"
        ) from None


# -- moving and removing: thin over one DlqAction -----------------------------------------


async def requeue(
    app: App,
    queue: str,
    *,
    limit: int | None = None,
    task_ids: Iterable[str] | None = None,
) -> int:
    """Shovel messages from ``Q.dlq`` back to ``Q``: all, the first ``limit``, or those whose
    task id is in ``task_ids`` (the others stay in the DLQ, unchanged and in order). How many
    moved. ``DlqAction("requeue", ...)`` is the same with any filter, a rate and a preview."""
    wanted = list(task_ids) if task_ids is not None else None
    if wanted is not None and not wanted:
        return 0
    action = DlqAction("requeue", queue, DlqFilter.of(task_ids=wanted), limit)
    return (await action.apply(app)).acted


async def purge(app: App, queue: str) -> int:
    """Delete every ready message in ``Q.dlq`` for good; how many were removed."""
    return (await DlqAction("purge", queue).apply(app)).acted


async def purge_matching(
    app: App, queue: str, *, where: DlqFilter, limit: int | None = None
) -> Outcome:
    """Delete for good the dead letters ``where`` selects (the first ``limit`` of them, in
    queue order); the others stay, unchanged and in order. ``DlqAction("purge", ...)``."""
    return await DlqAction("purge", queue, where, limit).apply(app)

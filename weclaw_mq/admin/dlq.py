"""Operating a handler's dead-letter queue ``Q.dlq``: look, export, shovel back, purge.

What a dead letter says is read by ``weclaw_mq.dlq_message``; this module holds the broker
side. Every move is "publish with confirm, then ack the DLQ copy", like every other hop: a
crash in between duplicates, never loses. That holds for looking too: a look rotates the DLQ
(see ``_Pass``) rather than taking messages and handing them back.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from .. import headers as h
from ..app import App
from ..broker_version import parse_server_version
from ..errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    ConnectionLostError,
    PublishNackedError,
    UnroutableError,
    WeclawMQError,
)
from ..lifetime import as_datetime, deadline_ms, now_ms
from ..naming import dlq_name
from ..priority import priority_from_header, route
from ..state import TaskState, TaskStatus, TaskStore
from ..undecodable import tolerant_properties, undecodable
from .dlq_message import (
    DeadLetter,
    export_record,
    kept_properties,
    read_dead_letter,
    requeued_properties,
)

log = logging.getLogger("weclaw_mq.dlq")

UNREADABLE_REASON = "unreadable"


def _read(message: DeliveredMessage) -> DeadLetter:
    """What the message says; a message our reader trips over is shown as unreadable (with
    its raw headers and body) instead of stopping the look at the whole DLQ."""
    props = message.header.properties
    try:
        return read_dead_letter(props.message_id, props.headers or {}, message.body)
    except Exception as e:  # another producer's message: anything may be in it
        headers = props.headers if isinstance(props.headers, dict) else {}
        return DeadLetter(
            task_id=props.message_id if isinstance(props.message_id, str) else "",
            reason=UNREADABLE_REASON,
            error_type=type(e).__name__,
            error_message=str(e),
            attempts=None,
            original_queue=None,
            first_failure_at=None,
            last_failure_at=None,
            trace_id=None,
            body=message.body,
            headers=dict(headers),
        )


@contextlib.asynccontextmanager
async def connected(app: App, purpose: str) -> AsyncIterator[AbstractConnection]:
    """One connection per ops command; a lost broker raised as BrokerUnavailableError."""
    conn = await app.broker.connect(name=f"{app.name}-dlq-{purpose}")
    try:
        yield conn
    except aiormq.exceptions.InvalidFrameError as e:
        raise BrokerUnavailableError(
            f"dlq {purpose} stopped: the client cannot decode a frame from the broker ({e}); "
            "messages not yet moved stay where they were"
        ) from e
    except (aiormq.exceptions.AMQPError, ConnectionError) as e:
        raise BrokerUnavailableError(
            f"lost the broker during dlq {purpose}: {type(e).__name__}: {e}; messages not yet "
            "moved stay where they were"
        ) from e
    finally:
        with contextlib.suppress(Exception):
            await conn.close()


async def ready_count(conn: AbstractConnection, name: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of ``name``, or None when no such queue exists."""
    # A passive declare of a missing queue closes its channel (404): one channel per look.
    channel = await conn.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    finally:
        if not channel.is_closed:
            await channel.close()
    result = declared.declaration_result
    return result.message_count or 0, result.consumer_count or 0


async def _dlq_depth(conn: AbstractConnection, queue: str) -> int:
    counts = await ready_count(conn, dlq_name(queue))
    if counts is None:
        raise ConfigurationError(
            f"no queue named {dlq_name(queue)!r}: check the handler queue name {queue!r} "
            "(the DLQ is declared with it by 'weclaw-mq declare' or a worker)"
        )
    return counts[0]


# -- reading the DLQ without changing it ---------------------------------------------------


@dataclass
class _Pass:
    """One pass over ``Q.dlq``: each message present when it started is taken once and then
    either kept (an exact copy published to the tail with a confirm, then the original acked)
    or moved elsewhere by the caller.

    AMQP 0-9-1 has no "browse". Taking a message and handing it back (basic.get without ack,
    then closing the channel) marks it redelivered and raises its x-delivery-count; on
    RabbitMQ 4.0+ a quorum DLQ has a default delivery limit of 20 and nowhere to dead-letter
    to, so the 20th look would drop every dead letter. A rotation hands nothing back, on
    every version: body, properties and headers stay as they were (x-delivery-count, the
    broker's count of returns in this queue, is left off the copy, which was never
    returned), and a whole pass ends with the messages in their old order. A crash between a
    copy's confirm and the original's ack leaves both: a duplicate, never a loss.

    We use aiormq's channel under aio-pika's: its message carries the properties exactly as
    decoded, which we publish back untouched, so no conversion of ours can alter them.
    """

    channel: aiormq.abc.AbstractChannel
    dlq: str
    budget: int  # messages in the DLQ at the start: arrivals and our copies are not taken
    confirm_timeout_s: float

    async def next(self) -> DeliveredMessage | None:
        if self.budget <= 0:
            return None
        self.budget -= 1
        got = await self.channel.basic_get(self.dlq, no_ack=False)
        if not isinstance(got.delivery, Basic.GetOk):
            self.budget = 0  # empty (another reader took the rest)
            return None
        return got

    async def keep(self, message: DeliveredMessage) -> None:
        await self.publish(self.dlq, message.body, kept_properties(message.header.properties))
        await self.ack(message)

    async def ack(self, message: DeliveredMessage) -> None:
        tag = message.delivery.delivery_tag if isinstance(message.delivery, Basic.GetOk) else None
        if tag is None:  # pragma: no cover - every message of a pass came from a get-ok
            raise ConfigurationError("internal: a DLQ message without a delivery tag")
        await self.channel.basic_ack(tag)

    async def publish(self, queue: str, body: bytes, properties: Basic.Properties) -> None:
        """Publish with a confirm; a typed error when the broker did not take it."""
        task_id = properties.message_id or ""
        try:
            confirm = await self.channel.basic_publish(
                body,
                exchange="",
                routing_key=queue,
                properties=properties,
                mandatory=True,
                timeout=self.confirm_timeout_s,
            )
        except aiormq.exceptions.PublishError as e:
            raise UnroutableError(
                f"{queue!r} refused the copy of {task_id}: no such queue ({e})",
                queue=queue,
                task_id=task_id,
            ) from e
        except TimeoutError as e:
            raise ConfirmTimeoutError(
                f"no confirm for the copy of {task_id} in {self.confirm_timeout_s} s; its "
                "original stays in the DLQ",
                queue=queue,
                task_id=task_id,
            ) from e
        except aiormq.exceptions.DeliveryError as e:
            raise PublishNackedError(
                f"{queue!r} refused the copy of {task_id}; its original stays in the DLQ",
                queue=queue,
                task_id=task_id,
            ) from e
        except (aiormq.exceptions.AMQPError, ConnectionError) as e:
            raise ConnectionLostError(
                f"the link died before the copy of {task_id} was confirmed: {e}",
                queue=queue,
                task_id=task_id,
            ) from e
        if not isinstance(confirm, Basic.Ack):
            raise PublishNackedError(
                f"{queue!r} refused the copy of {task_id}; its original stays in the DLQ",
                queue=queue,
                task_id=task_id,
            )

    async def keep_the_rest(self) -> None:
        """Finish the pass, so the messages keep their order."""
        while (message := await self.next()) is not None:
            await self.keep(message)


@contextlib.asynccontextmanager
async def _pass(app: App, queue: str, purpose: str) -> AsyncIterator[_Pass]:
    # Held from before the connection opens until after it closed: its reader decodes.
    with tolerant_properties():
        async with _pass_on_connection(app, queue, purpose) as dlq:
            yield dlq


@contextlib.asynccontextmanager
async def _pass_on_connection(app: App, queue: str, purpose: str) -> AsyncIterator[_Pass]:
    async with connected(app, purpose) as conn:
        depth = await _dlq_depth(conn, queue)
        channel: AbstractChannel = await conn.channel(publisher_confirms=True)
        try:
            yield _Pass(
                await channel.get_underlay_channel(),
                dlq_name(queue),
                depth,
                app.settings.confirm_timeout_s,
            )
        finally:
            # Anything taken and not yet settled (an error stopped us) goes back to the DLQ.
            with contextlib.suppress(Exception):
                if not channel.is_closed:
                    await channel.close()


async def inspect(app: App, queue: str, *, limit: int | None = 100) -> list[DeadLetter]:
    """Up to ``limit`` messages of ``Q.dlq`` (None: all), left in the DLQ unchanged."""
    found: list[DeadLetter] = []
    async with _pass(app, queue, "inspect") as dlq:
        while (message := await dlq.next()) is not None:
            if limit is None or len(found) < limit:
                found.append(_read(message))
            await dlq.keep(message)
    return found


async def find(app: App, queue: str, task_id: str) -> DeadLetter | None:
    """The first message of ``Q.dlq`` with this task id, left in the DLQ; None if none."""
    found: DeadLetter | None = None
    async with _pass(app, queue, "show") as dlq:
        while (message := await dlq.next()) is not None:
            if found is None and message.header.properties.message_id == task_id:
                found = _read(message)
            await dlq.keep(message)
    return found


async def export(app: App, queue: str, path: str | Path, *, limit: int | None = None) -> int:
    """Write ``Q.dlq`` as JSON lines to ``path`` (left in the DLQ); how many were written."""
    written = 0
    async with _pass(app, queue, "export") as dlq:
        # Opened once the DLQ is known to exist, so a typo never truncates a file. Blocking
        # writes are fine here: small buffered lines to a local file, from an ops command.
        with Path(path).open("w", encoding="utf-8") as out:  # noqa: ASYNC230
            while (message := await dlq.next()) is not None:
                if limit is None or written < limit:
                    out.write(json.dumps(export_record(_read(message))) + "\n")
                    written += 1
                await dlq.keep(message)
    return written


# -- moving and removing ------------------------------------------------------------------


class _QueuedStatus:
    """Best effort "queued" records: the task is safe in the broker whatever Redis says, so
    after the first failure we stop asking (each try may wait seconds on a dead Redis)."""

    def __init__(self, store: TaskStore | None, queue: str) -> None:
        self._store = store
        self._queue = queue

    async def mark(self, task_id: str, expires_at: datetime | None) -> TaskState | None:
        """Record "queued"; returns the record it replaced, to restore if the move fails."""
        if self._store is None or not task_id:
            return None
        try:
            before = await self._store.get(task_id, queue=self._queue)
            await self._store.record(
                TaskState(
                    task_id=task_id,
                    queue=self._queue,
                    status=TaskStatus.QUEUED,
                    expires_at=expires_at,
                )
            )
        except Exception as e:  # Redis down or failing: the same answer either way
            self._give_up(e)
            return None
        return before

    async def restore(self, before: TaskState | None) -> None:
        if self._store is None or before is None:
            return
        try:
            await self._store.record(before)
        except Exception as e:
            self._give_up(e)

    def _give_up(self, e: Exception) -> None:
        log.warning(
            "cannot record task statuses (%s: %s); requeueing goes on without them",
            type(e).__name__,
            e,
        )
        self._store = None


async def requeue(
    app: App,
    queue: str,
    *,
    limit: int | None = None,
    task_ids: Iterable[str] | None = None,
) -> int:
    """Shovel messages from ``Q.dlq`` back to ``Q``: all, the first ``limit``, or those whose
    task id is in ``task_ids`` (the others stay in the DLQ, unchanged and in order). How many
    moved.

    Each copy starts again at attempt 1 without the failure headers, counts the trip in
    ``headers.REQUEUED``, and is confirmed by the broker before its DLQ copy is acked.
    """
    wanted = set(task_ids) if task_ids is not None else None
    if wanted is not None and not wanted:
        return 0
    statuses = _QueuedStatus(app.results, queue)
    moved = skipped = 0
    async with _pass(app, queue, "requeue") as dlq:
        try:
            while limit is None or moved < limit:
                message = await dlq.next()
                if message is None:
                    break
                task_id = message.header.properties.message_id or ""
                if undecodable(message.header.properties.headers) is not None:
                    # It would only kill its worker's connection again and again.
                    skipped += 1
                    await dlq.keep(message)
                    continue
                if wanted is not None and task_id not in wanted:
                    await dlq.keep(message)
                    continue
                await _move_back(message, dlq, statuses, queue, app.queue_type_of(queue))
                moved += 1
            if wanted is not None:
                await dlq.keep_the_rest()  # the pass ends with the others in their order
        except WeclawMQError:
            if moved:  # the error says why it stopped; only we know how far it got
                log.error("requeue stopped after moving %d message(s) to %s", moved, queue)
            raise
    if skipped:
        log.warning(
            "left %d message(s) in %s whose properties the client cannot decode (listed as "
            "undecodable_properties); see the README's DLQ section",
            skipped,
            dlq_name(queue),
        )
    return moved


async def _move_back(
    message: DeliveredMessage, dlq: _Pass, statuses: _QueuedStatus, queue: str, queue_type: str
) -> None:
    properties = message.header.properties
    # Back to the lane its priority header names (the AMQP priority property, on a native
    # plan, is kept by requeued_properties).
    headers = properties.headers if isinstance(properties.headers, Mapping) else {}
    version = parse_server_version(dlq.channel.connection.server_properties.get("version"))
    target, _ = route(queue, priority_from_header(headers.get(h.PRIORITY)), version, queue_type)
    # "queued" is written BEFORE the copy exists: a worker's running/succeeded/dead_lettered
    # record then always lands after it, and a waiter never sees a stale final state.
    copy = requeued_properties(properties, at_ms=now_ms())
    before = await statuses.mark(
        copy.message_id or "", as_datetime(deadline_ms(copy.headers or {}))
    )
    try:
        await dlq.publish(target, message.body, copy)
    except WeclawMQError:
        await statuses.restore(before)
        raise  # the DLQ copy stays unacked and returns to the DLQ
    # Acked only after the confirm: a crash in between leaves a duplicate, never a loss.
    await dlq.ack(message)


async def purge(app: App, queue: str) -> int:
    """Delete every ready message in ``Q.dlq`` for good; how many were removed."""
    async with connected(app, "purge") as conn:
        await _dlq_depth(conn, queue)  # a clear error for a missing DLQ
        channel = await conn.channel()
        try:
            dlq = await channel.get_queue(dlq_name(queue), ensure=False)
            result = await dlq.purge()
        finally:
            if not channel.is_closed:
                await channel.close()
    return (result.message_count or 0) if result is not None else 0

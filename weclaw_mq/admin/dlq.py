"""Operating a handler's dead-letter queue ``Q.dlq``: look, export, import, shovel back, purge.

What a dead letter says is read by ``dlq_message``, which of them a command acts on is decided
by ``dlq_filter``; this module holds the broker side. Every move is "publish with confirm,
then ack the DLQ copy", like every other hop: a crash in between duplicates, never loses.
That holds for looking too: a look rotates the DLQ (see ``_Pass``) rather than taking
messages and handing them back.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TextIO

import aiormq
import yarl
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_filter import EVERYTHING, DlqFilter
from weclaw_mq.admin.dlq_message import (
    DeadLetter,
    encoded_properties,
    export_record,
    kept_properties,
    read_dead_letter,
    record_body,
    record_properties,
    requeued_properties,
)
from weclaw_mq.app import App
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms, now_ms
from weclaw_mq.contract.naming import UNROUTABLE, dlq_name, handler_queue_of
from weclaw_mq.contract.undecodable import tolerant_properties, undecodable
from weclaw_mq.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    ConnectionLostError,
    PayloadError,
    PublishNackedError,
    UnroutableError,
    WeclawMQError,
)
from weclaw_mq.policy.broker_version import parse_server_version
from weclaw_mq.policy.priority import priority_from_header, route
from weclaw_mq.state import TaskState, TaskStatus, TaskStore

log = logging.getLogger("weclaw_mq.dlq")

UNREADABLE_REASON = "unreadable"


# aio-pika logs in as guest when the URL names no user.
DEFAULT_USER = "guest"


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
    async with _pass(app, queue, "inspect") as dlq:
        while (message := await dlq.next()) is not None:
            total += 1
            dead = _read(message)
            if where.matches(dead):
                matched += 1
                if limit is None or len(shown) < limit:
                    shown.append(_trimmed(dead, body_max))
            await dlq.keep(message)
    return Looked(shown, matched, total)


def _trimmed(dead: DeadLetter, body_max: int | None) -> DeadLetter:
    if body_max is None or len(dead.body) <= body_max:
        return dead
    return replace(dead, body=dead.body[:body_max], body_size=len(dead.body))


async def inspect(
    app: App, queue: str, *, limit: int | None = 100, where: DlqFilter = EVERYTHING
) -> list[DeadLetter]:
    """Up to ``limit`` messages of ``Q.dlq`` (None: all), left in the DLQ unchanged."""
    return (await look(app, queue, where=where, limit=limit)).shown


async def find(app: App, queue: str, task_id: str) -> DeadLetter | None:
    """The first message of ``Q.dlq`` with this task id, left in the DLQ; None if none."""
    found: DeadLetter | None = None
    async with _pass(app, queue, "show") as dlq:
        while (message := await dlq.next()) is not None:
            if found is None and message.header.properties.message_id == task_id:
                found = _read(message)
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
    async with _pass(app, queue, "export") as dlq:
        with _opened(path) as out:
            while (message := await dlq.next()) is not None:
                dead = _read(message)
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
    async with _pass(app, queue, "import") as dlq:
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


# -- moving and removing ------------------------------------------------------------------


class _QueuedStatus:
    """Best effort "queued" records: the task is safe in the broker whatever Redis says, so
    after the first failure we stop asking (each try may wait seconds on a dead Redis)."""

    def __init__(self, store: TaskStore | None, queue: str) -> None:
        self._store = store
        self._queue = queue

    async def mark(
        self, task_id: str, expires_at: datetime | None, queue: str | None = None
    ) -> TaskState | None:
        """Record "queued" (in ``queue``, else the one this pass moves to); returns the record
        it replaced, to restore if the move fails."""
        if self._store is None or not task_id:
            return None
        queue = queue or self._queue
        try:
            before = await self._store.get(task_id, queue=queue)
            await self._store.record(
                TaskState(
                    task_id=task_id,
                    queue=queue,
                    status=TaskStatus.QUEUED,
                    expires_at=expires_at,
                    session_id=before.session_id if before is not None else None,
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


@dataclass
class RequeueSummary:
    """How a requeue (or its dry run) ended, counted over the dead letters it visited."""

    moved: int = 0  # confirmed in Q (dry run: would be moved)
    skipped: int = 0  # selected, but properties no client decodes: left in the DLQ
    failed: int = 0  # selected, refused by the broker (no such lane, a nack): left in the DLQ
    kept: int = 0  # not selected (or past --limit): left in the DLQ, in order
    selected: list[DeadLetter] = field(default_factory=list)  # dry run only: what would move


# (messages visited, messages in the DLQ when the pass started): for a progress bar.
Progress = Callable[[int, int], None]


class _Pace:
    """At most ``rate_per_s`` moves per second: the n-th move waits until n / rate seconds
    after the first (a steady rate; a slow broker never causes a burst to catch up)."""

    def __init__(self, rate_per_s: float | None) -> None:
        self._interval_s = 1 / rate_per_s if rate_per_s else 0.0
        self._next_at: float | None = None

    async def wait(self) -> None:
        if not self._interval_s:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._next_at is None or self._next_at < now:
            self._next_at = now
        # An ops tool's deliberate pacing, not synchronisation: nothing else to wait on.
        await asyncio.sleep(self._next_at - now)
        self._next_at += self._interval_s


async def requeue(
    app: App,
    queue: str,
    *,
    limit: int | None = None,
    task_ids: Iterable[str] | None = None,
) -> int:
    """Shovel messages from ``Q.dlq`` back to ``Q``: all, the first ``limit``, or those whose
    task id is in ``task_ids`` (the others stay in the DLQ, unchanged and in order). How many
    moved. ``redrive`` is the same with filters, a rate, a dry run and a summary."""
    wanted = list(task_ids) if task_ids is not None else None
    if wanted is not None and not wanted:
        return 0
    where = DlqFilter.of(task_ids=wanted)
    return (await redrive(app, queue, where=where, limit=limit)).moved


def _untouched(summary: RequeueSummary) -> bool:
    return not (summary.kept or summary.skipped or summary.failed or summary.selected)


async def redrive(
    app: App,
    queue: str,
    *,
    where: DlqFilter = EVERYTHING,
    limit: int | None = None,
    rate_per_s: float | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
    body_max: int | None = None,
) -> RequeueSummary:
    """Move the dead letters ``where`` selects (the first ``limit`` of them) back to ``Q``;
    the others stay in the DLQ, unchanged and in order.

    Each copy starts again at attempt 1 without the failure headers, counts the trip in
    ``headers.REQUEUED`` and its time in ``headers.REQUEUED_AT``, and is confirmed by the
    broker before its DLQ copy is acked: one message at a time, so a requeue killed at any
    instant leaves at most one message both in Q and in the DLQ (a duplicate, never a loss).
    A copy the broker refuses (its lane does not exist, a nack) is counted as failed and its
    original kept; a lost broker or a missing confirm stops the run (the error says why).
    ``dry_run`` moves nothing: it is a look that lists what would move (each listed body
    cut to ``body_max`` bytes, as in ``look``).
    """
    statuses = _QueuedStatus(app.results, queue)
    summary = RequeueSummary()
    visited = 0
    async with _pass(app, queue, "requeue") as dlq:
        total = dlq.budget
        pace = _Pace(rate_per_s)
        try:
            while (message := await dlq.next()) is not None:
                visited += 1
                dead = _read(message)
                room = limit is None or summary.moved < limit
                if not (room and where.matches(dead)):
                    summary.kept += 1
                    await dlq.keep(message)
                elif undecodable(message.header.properties.headers) is not None:
                    # It would only kill its worker's connection again and again.
                    summary.skipped += 1
                    await dlq.keep(message)
                elif dry_run:
                    summary.moved += 1
                    summary.selected.append(_trimmed(dead, body_max))
                    await dlq.keep(message)
                else:
                    await pace.wait()
                    spec = app.handlers.get(queue)
                    fair = spec is not None and spec.fair is not None
                    kind = app.queue_type_of(queue)
                    if await _move_back(message, dlq, statuses, queue, kind, fair):
                        summary.moved += 1
                    else:
                        summary.failed += 1
                if progress is not None:
                    progress(visited, total)
                if limit is not None and summary.moved >= limit and _untouched(summary):
                    # Nothing was rotated to the tail: the rest are still at the head, in
                    # order, and need not be visited.
                    break
        except WeclawMQError:
            if summary.moved and not dry_run:  # the error says why; only we know how far
                log.error("requeue stopped after moving %d message(s) to %s", summary.moved, queue)
            raise
    if summary.skipped:
        log.warning(
            "left %d message(s) in %s whose properties the client cannot decode (listed as "
            "undecodable_properties); see docs/operations/dlq.md",
            summary.skipped,
            dlq_name(queue),
        )
    return summary


async def _move_back(
    message: DeliveredMessage,
    dlq: _Pass,
    statuses: _QueuedStatus,
    queue: str,
    queue_type: str,
    fair: bool = False,
) -> bool:
    """Publish a requeued copy with a confirm, then ack the original: True. False when the
    broker refused the copy (no such queue, a nack): the original is kept in the DLQ."""
    properties = message.header.properties
    # Back to the lane its priority header names (the AMQP priority property, on a native
    # plan, is kept by requeued_properties).
    headers = properties.headers if isinstance(properties.headers, Mapping) else {}
    version = parse_server_version(dlq.channel.connection.server_properties.get("version"))
    level = priority_from_header(headers.get(h.PRIORITY))
    target, _ = route(queue, level, version, queue_type, fair=fair)
    owner = None
    if queue == UNROUTABLE:
        # The parking queue: back to the lane the shared ladder was returning it to, once
        # that queue exists again.
        target = parked_for(headers) or target
        owner = handler_queue_of(target)
    # "queued" is written BEFORE the copy exists: a worker's running/succeeded/dead_lettered
    # record then always lands after it, and a waiter never sees a stale final state.
    copy = requeued_properties(properties, at_ms=now_ms())
    before = await statuses.mark(
        copy.message_id or "", as_datetime(deadline_ms(copy.headers or {})), owner
    )
    try:
        await dlq.publish(target, message.body, copy)
    except (UnroutableError, PublishNackedError) as e:
        # Certainly not in Q: this one stays in the DLQ, the others may still go.
        await statuses.restore(before)
        log.warning("left %s in %s: %s", copy.message_id or "a message", dlq.dlq, e)
        await dlq.keep(message)
        return False
    except WeclawMQError:
        await statuses.restore(before)
        raise  # the DLQ copy stays unacked and returns to the DLQ
    # Acked only after the confirm: a crash in between leaves a duplicate, never a loss.
    await dlq.ack(message)
    return True


def parked_for(headers: Mapping[str, object]) -> str | None:
    """The lane a parked task was on its way back to: the routing key of its latest death
    (the delay queue's expiry), which a look's rotation keeps, unlike the routing key."""
    deaths = headers.get(h.X_DEATH)
    if not isinstance(deaths, list) or not deaths or not isinstance(deaths[0], Mapping):
        return None
    keys = deaths[0].get("routing-keys")
    if isinstance(keys, list) and keys and isinstance(keys[0], (str, bytes)):
        key = keys[0]
        return key.decode() if isinstance(key, bytes) else key
    return None


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


@dataclass
class PurgeSummary:
    removed: int = 0  # deleted (dry run: would be deleted)
    kept: int = 0  # not selected (or past the limit): left in the DLQ, in order
    selected: list[DeadLetter] = field(default_factory=list)  # dry run only


async def purge_matching(
    app: App,
    queue: str,
    *,
    where: DlqFilter,
    limit: int | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
    body_max: int | None = None,
) -> PurgeSummary:
    """Delete for good the dead letters ``where`` selects (the first ``limit`` of them, in
    queue order); the others stay, unchanged and in order (a pass that acks the selected and
    keeps the rest). ``dry_run`` deletes nothing; ``progress`` is told of each message
    visited and ``body_max`` cuts the bodies a dry run lists, as in ``redrive``."""
    summary = PurgeSummary()
    visited = 0
    async with _pass(app, queue, "purge") as dlq:
        total = dlq.budget
        while (message := await dlq.next()) is not None:
            visited += 1
            dead = _read(message)
            room = limit is None or summary.removed < limit
            if not (room and where.matches(dead)):
                summary.kept += 1
                await dlq.keep(message)
            elif dry_run:
                summary.removed += 1
                summary.selected.append(_trimmed(dead, body_max))
                await dlq.keep(message)
            else:
                summary.removed += 1
                await dlq.ack(message)
            if progress is not None:
                progress(visited, total)
            if limit is not None and summary.removed >= limit and not (summary.kept or dry_run):
                break  # nothing rotated to the tail: the rest are still at the head, in order
    return summary

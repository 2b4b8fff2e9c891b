"""Operating a handler's dead-letter queue ``Q.dlq``: look, export, shovel back, purge.

What a dead letter says is read by ``weclaw_mq.dead_letter``; this module holds the broker
side. Every move back to ``Q`` is "publish with confirm, then ack the DLQ copy", like every
other hop: a crash in between duplicates, never loses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue

from .app import App
from .dead_letter import DeadLetter, export_record, read_dead_letter, requeued_message
from .errors import BrokerUnavailableError, ConfigurationError, WeclawMQError
from .naming import dlq_name
from .producer import Publisher
from .results import ResultStore, TaskState, TaskStatus

log = logging.getLogger("weclaw_mq.dlq")

# How long a look waits for the messages it handed back to show in the DLQ again.
RETURN_WAIT_S = 5.0


def _dead_letter(message: AbstractIncomingMessage) -> DeadLetter:
    return read_dead_letter(message.message_id, message.headers or {}, message.body)


# -- reading the DLQ without taking from it ----------------------------------------------


class _Taker:
    """basic.get without ack, at most as many messages as the queue held when we started:
    messages dead-lettered meanwhile do not keep a look at a busy DLQ going forever."""

    def __init__(self, queue: AbstractQueue, budget: int) -> None:
        self._queue = queue
        self._budget = budget
        self.held = 0  # taken and not acked: handed back when the channel closes

    async def next(self) -> AbstractIncomingMessage | None:
        if self._budget <= 0:
            return None
        self._budget -= 1
        message = await self._queue.get(no_ack=False, fail=False)
        if message is not None:
            self.held += 1
        return message

    async def ack(self, message: AbstractIncomingMessage) -> None:
        await message.ack()
        self.held -= 1


@contextlib.asynccontextmanager
async def connected(app: App, purpose: str) -> AsyncIterator[AbstractConnection]:
    """One connection per ops command; a lost broker raised as BrokerUnavailableError."""
    conn = await app.broker.connect(name=f"{app.name}-dlq-{purpose}")
    try:
        yield conn
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


@contextlib.asynccontextmanager
async def _taking(
    app: App, queue: str, purpose: str
) -> AsyncIterator[tuple[AbstractConnection, _Taker]]:
    dlq = dlq_name(queue)
    async with connected(app, purpose) as conn:
        depth = await _dlq_depth(conn, queue)
        channel = await conn.channel()
        taker = _Taker(await channel.get_queue(dlq, ensure=False), depth)
        try:
            yield conn, taker
        except BaseException:
            with contextlib.suppress(Exception):
                if not channel.is_closed:
                    await channel.close()
            raise
        await _hand_back(conn, channel, dlq, taker.held)


async def _hand_back(
    conn: AbstractConnection, channel: AbstractChannel, dlq: str, held: int
) -> None:
    """Close the channel, so every message still unacked on it returns to the DLQ, and wait
    until the broker shows them again.

    AMQP 0-9-1 has no "browse": a look is a basic.get without ack, and closing the channel
    gives the messages back. That is safe: the broker keeps an unacked message until it is
    acked, and a channel or connection that dies (even this process under kill -9) returns
    it just the same; the DLQ has no delivery limit, so nothing is dead-lettered or dropped.
    The cost: each returned message is marked redelivered, its x-delivery-count goes up by
    one, and a quorum queue serves returned messages first, so the DLQ's order can change.
    While we hold them, other readers of the DLQ do not see them.

    A quorum queue applies the return after the channel is gone (seen on 3.10.8: the DLQ
    still counted 0 right after close-ok), so without the wait a "list" followed at once by
    "requeue" would find nothing to move.
    """
    if channel.is_closed:
        return  # closed under us: returned all the same, but nothing to wait on here
    before = await ready_count(conn, dlq) if held else None
    await channel.close()
    if before is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETURN_WAIT_S
    while True:
        now = await ready_count(conn, dlq)
        # ">=" and a deadline: messages dead-lettered meanwhile only make it sooner; another
        # reader taking messages from the DLQ could keep it from ever matching.
        if now is None or now[0] >= before[0] + held:
            return
        if loop.time() > deadline:
            log.warning(
                "%d message(s) handed back to %s are not all visible after %.0f s; they "
                "are still in the broker (another reader may hold them)",
                held,
                dlq,
                RETURN_WAIT_S,
            )
            return
        await asyncio.sleep(0.02)


async def inspect(app: App, queue: str, *, limit: int | None = 100) -> list[DeadLetter]:
    """Up to ``limit`` messages of ``Q.dlq`` (None: all), left in the DLQ."""
    found: list[DeadLetter] = []
    async with _taking(app, queue, "inspect") as (_, taker):
        while limit is None or len(found) < limit:
            message = await taker.next()
            if message is None:
                break
            found.append(_dead_letter(message))
    return found


async def find(app: App, queue: str, task_id: str) -> DeadLetter | None:
    """The first message of ``Q.dlq`` with this task id, left in the DLQ; None if none."""
    async with _taking(app, queue, "show") as (_, taker):
        while (message := await taker.next()) is not None:
            if message.message_id == task_id:
                return _dead_letter(message)
    return None


async def export(app: App, queue: str, path: str | Path, *, limit: int | None = None) -> int:
    """Write ``Q.dlq`` as JSON lines to ``path`` (left in the DLQ); how many were written."""
    written = 0
    async with _taking(app, queue, "export") as (_, taker):
        # Opened once the DLQ is known to exist, so a typo never truncates a file. Blocking
        # writes are fine here: small buffered lines to a local file, from an ops command.
        with Path(path).open("w", encoding="utf-8") as out:  # noqa: ASYNC230
            while limit is None or written < limit:
                message = await taker.next()
                if message is None:
                    break
                out.write(json.dumps(export_record(_dead_letter(message))) + "\n")
                written += 1
    return written


# -- moving and removing ------------------------------------------------------------------


class _QueuedStatus:
    """Best effort "queued" records: the task is safe in the broker whatever Redis says, so
    after the first failure we stop asking (each try may wait seconds on a dead Redis)."""

    def __init__(self, store: ResultStore | None, queue: str) -> None:
        self._store = store
        self._queue = queue

    async def mark(self, task_id: str) -> TaskState | None:
        """Record "queued"; returns the record it replaced, to restore if the move fails."""
        if self._store is None or not task_id:
            return None
        try:
            before = await self._store.get(task_id, queue=self._queue)
            await self._store.put(
                TaskState(task_id=task_id, queue=self._queue, status=TaskStatus.QUEUED)
            )
        except Exception as e:  # Redis down or failing: the same answer either way
            self._give_up(e)
            return None
        return before

    async def restore(self, before: TaskState | None) -> None:
        if self._store is None or before is None:
            return
        try:
            await self._store.put(before)
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
    task id is in ``task_ids`` (others are returned to the DLQ untouched). How many moved.

    Each copy starts again at attempt 1 without the failure headers, counts the trip in
    ``headers.REQUEUED``, and is confirmed by the broker before its DLQ copy is acked.
    """
    wanted = set(task_ids) if task_ids is not None else None
    if wanted is not None and not wanted:
        return 0
    statuses = _QueuedStatus(app.results, queue)
    moved = 0
    seen: set[str] = set()
    async with _taking(app, queue, "requeue") as (conn, taker):
        publisher = Publisher(app.broker, app.metrics, name=f"{app.name}-dlq", connection=conn)
        try:
            while limit is None or moved < limit:
                # Stop once every asked-for id moved, rather than pulling a whole big DLQ
                # through this channel for ids that are not there.
                if wanted is not None and wanted <= seen:
                    break
                message = await taker.next()
                if message is None:
                    break
                task_id = message.message_id or ""
                if wanted is not None and task_id not in wanted:
                    continue  # held unacked: back in the DLQ when the channel closes
                await _move_back(message, taker, publisher, statuses, queue)
                seen.add(task_id)
                moved += 1
        except WeclawMQError:
            if moved:  # the error says why it stopped; only we know how far it got
                log.error("requeue stopped after moving %d message(s) to %s", moved, queue)
            raise
        finally:
            await publisher.close()
    return moved


async def _move_back(
    message: AbstractIncomingMessage,
    taker: _Taker,
    publisher: Publisher,
    statuses: _QueuedStatus,
    queue: str,
) -> None:
    # "queued" is written BEFORE the copy exists: a worker's running/succeeded/dead_lettered
    # record then always lands after it, and a waiter never sees a stale final state.
    before = await statuses.mark(message.message_id or "")
    try:
        await publisher.publish(queue, requeued_message(message))
    except WeclawMQError:
        await statuses.restore(before)
        raise  # the DLQ copy stays unacked and returns to the DLQ
    # Acked only after the confirm: a crash in between leaves a duplicate, never a loss.
    await taker.ack(message)


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

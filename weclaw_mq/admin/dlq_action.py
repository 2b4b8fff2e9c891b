"""Requeue and purge as one action object, ``DlqAction``: the queue, the filter, the limit
(and a requeue's rate). Its ``preview`` and its ``apply`` walk ``Q.dlq`` through the same
selection, so an apply acts on what its preview listed. Every front end builds one and calls
it: ``weclaw-mq dlq requeue / purge`` (``cli.dlq_commands``), the console's bulk actions and
its one-task requeue (``console.dead_letters``), and ``admin.dlq.requeue / purge_matching``.

A walk is one pass (``dlq_pass``): each dead letter present at the start is taken once and is
either acted on (a requeue publishes a copy to ``Q`` with a confirm, then acks it; a purge
acks it) or rotated back to the tail. A preview acts on nothing: it is a look that lists
what the apply would take. A confirmed console preview applies ``pinned``: the task ids it
listed, or, for a big one, its filter with a limit of the count it listed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Literal

from aiormq.abc import DeliveredMessage

from weclaw_mq.admin.dlq_filter import EVERYTHING, DlqFilter
from weclaw_mq.admin.dlq_message import DeadLetter, requeued_properties
from weclaw_mq.admin.dlq_pass import (
    Pass,
    Progress,
    connected,
    dlq_depth,
    pass_over,
    read,
    trimmed,
)
from weclaw_mq.app import App
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms, now_ms
from weclaw_mq.contract.naming import UNROUTABLE, dlq_name, handler_queue_of
from weclaw_mq.contract.undecodable import undecodable
from weclaw_mq.errors import (
    ConfigurationError,
    PublishNackedError,
    UnroutableError,
    WeclawMQError,
)
from weclaw_mq.policy.broker_version import parse_server_version
from weclaw_mq.policy.priority import priority_from_header, route
from weclaw_mq.state import TaskState, TaskStatus, TaskStore

log = logging.getLogger("weclaw_mq.dlq")

ActionKind = Literal["requeue", "purge"]
ACTION_KINDS: tuple[ActionKind, ...] = ("requeue", "purge")


@dataclass
class Outcome:
    """What an action did (a preview: would do), counted over the dead letters it visited."""

    acted: int = 0  # moved to Q or removed (a preview: would be)
    kept: int = 0  # not selected (or past the limit): left in the DLQ, in order
    skipped: int = 0  # requeue: selected, but properties no client decodes: left in the DLQ
    failed: int = 0  # requeue: selected, refused by the broker (no such lane, a nack): left
    selected: list[DeadLetter] = field(default_factory=list)  # a preview's: what it would take


def pins_ids(task_ids: Sequence[str], by_id_max: int) -> bool:
    """Whether a preview that listed ``task_ids`` is applied by those ids (few, each named),
    rather than by its filter and their count."""
    return 0 < len(task_ids) <= by_id_max and all(task_ids)


@dataclass(frozen=True)
class DlqAction:
    """One requeue or purge of handler queue ``queue``'s DLQ.

    Attributes:
        kind: ``"requeue"`` (back to ``queue`` at attempt 1) or ``"purge"`` (deleted for good).
        queue: The handler queue ``Q``; the dead letters are in ``Q.dlq``.
        where: Which dead letters (``DlqFilter``); default all.
        limit: At most this many, the first selected in queue order; None: no limit.
        rate_per_s: A requeue's pace: at most this many moves per second.

    Raises:
        ConfigurationError: An unknown kind, a negative limit, a rate that is not above 0 or
            a rate on a purge.
    """

    kind: ActionKind
    queue: str
    where: DlqFilter = EVERYTHING
    limit: int | None = None
    rate_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ConfigurationError(f"{self.kind!r} is not a DLQ action: requeue or purge")
        if self.limit is not None and self.limit < 0:
            raise ConfigurationError(f"a DLQ action's limit is at least 0, not {self.limit}")
        if self.rate_per_s is not None and (self.kind != "requeue" or not self.rate_per_s > 0):
            raise ConfigurationError("a rate above 0 paces a requeue, and only a requeue")

    def pinned(self, task_ids: Sequence[str], *, by_id_max: int) -> DlqAction:
        """This action narrowed to what its preview listed (``task_ids``, in order): those
        task ids within its filter when ``pins_ids``, else its filter and their count as the
        limit. Dead letters that arrive after the preview are never taken."""
        if pins_ids(task_ids, by_id_max):
            return replace(self, where=replace(self.where, task_ids=frozenset(task_ids)))
        return replace(self, limit=len(task_ids))

    async def preview(
        self, app: App, *, progress: Progress | None = None, body_max: int | None = None
    ) -> Outcome:
        """What ``apply`` would take now, in ``selected`` (each body cut to ``body_max``
        bytes): a look, which moves nothing and leaves the order as it was."""
        return await _walk(app, self, dry_run=True, progress=progress, body_max=body_max)

    async def apply(self, app: App, *, progress: Progress | None = None) -> Outcome:
        """Carry the action out, one dead letter at a time; ``progress`` is told of each
        message visited.

        A requeued copy starts again at attempt 1 without the failure headers, counts the trip
        in ``headers.REQUEUED`` and its time in ``headers.REQUEUED_AT``, and is confirmed by the
        broker before its DLQ copy is acked: a requeue killed at any instant leaves at most one
        message both in Q and in the DLQ (a duplicate, never a loss). A copy the broker refuses
        is counted as failed and its original kept; a lost broker or a missing confirm stops
        the run (the error says why). A purge of every dead letter without a limit is the
        broker's purge of the queue (every ready message) in one call.
        """
        if self.kind == "purge" and self.where.everything and self.limit is None:
            return Outcome(acted=await _purge_queue(app, self.queue))
        return await _walk(app, self, dry_run=False, progress=progress, body_max=None)


async def _walk(
    app: App, action: DlqAction, *, dry_run: bool, progress: Progress | None, body_max: int | None
) -> Outcome:
    """One pass that selects with the action's filter and limit, and acts (or lists)."""
    done = Outcome()
    if action.limit == 0:
        return done
    queue, limit, requeue = action.queue, action.limit, action.kind == "requeue"
    mover = _Mover(app, queue) if requeue else None
    visited = 0
    async with pass_over(app, queue, action.kind) as dlq:
        total = dlq.budget
        pace = _Pace(action.rate_per_s)
        try:
            while (message := await dlq.next()) is not None:
                visited += 1
                dead = read(message)
                if not ((limit is None or done.acted < limit) and action.where.matches(dead)):
                    done.kept += 1
                    await dlq.keep(message)
                elif requeue and undecodable(message.header.properties.headers) is not None:
                    # It would only kill its worker's connection again and again.
                    done.skipped += 1
                    await dlq.keep(message)
                elif dry_run:
                    done.acted += 1
                    done.selected.append(trimmed(dead, body_max))
                    await dlq.keep(message)
                elif mover is None:
                    done.acted += 1
                    await dlq.ack(message)
                else:
                    await pace.wait()
                    if await mover.move_back(message, dlq):
                        done.acted += 1
                    else:
                        done.failed += 1
                if progress is not None:
                    progress(visited, total)
                rotated = done.kept or done.skipped or done.failed or dry_run
                if limit is not None and done.acted >= limit and not rotated:
                    break  # nothing rotated to the tail: the rest are still at the head, in order
        except WeclawMQError:
            if requeue and done.acted and not dry_run:  # the error says why; only we know how far
                log.error(
                    "requeue stopped after moving %d message(s) to %s", done.acted, action.queue
                )
            raise
    if done.skipped:
        log.warning(
            "left %d message(s) in %s whose properties the client cannot decode (listed as "
            "undecodable_properties); see docs/operations/dlq.md",
            done.skipped,
            dlq_name(queue),
        )
    return done


async def _purge_queue(app: App, queue: str) -> int:
    """Delete every ready message in ``Q.dlq``; how many were removed."""
    async with connected(app, "purge") as conn:
        await dlq_depth(conn, queue)  # a clear error for a missing DLQ
        channel = await conn.channel()
        try:
            dlq = await channel.get_queue(dlq_name(queue), ensure=False)
            result = await dlq.purge()
        finally:
            if not channel.is_closed:
                await channel.close()
    return (result.message_count or 0) if result is not None else 0


class _Mover:
    """Where a requeue sends each dead letter of one handler queue, and its "queued" records."""

    def __init__(self, app: App, queue: str) -> None:
        self._queue = queue
        spec = app.handlers.get(queue)
        self._fair = spec is not None and spec.fair is not None
        self._queue_type = app.queue_type_of(queue)
        self._statuses = _QueuedStatus(app.results, queue)

    async def move_back(self, message: DeliveredMessage, dlq: Pass) -> bool:
        return await _move_back(
            message, dlq, self._statuses, self._queue, self._queue_type, self._fair
        )


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


async def _move_back(
    message: DeliveredMessage,
    dlq: Pass,
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

"""``weclaw-mq migrate``: delete what an older version's topology left, once it holds nothing.

Older versions gave each handler its own delay queues (``Q.retry.lanes.<delay>``, before that
one set per lane, ``Q.retry.<delay>``) and every handler priority lanes. This version parks
delayed tasks in the vhost's shared ladder (``topology``) and gives lanes only to handlers
with ``priorities=True``. What the old queues hold is not lost: an old delay queue still
dead-letters each task back to its lane by name when its delay ends, and a worker of this
version consumes it there. So migrating is only deleting, and only what is empty:

- an old delay queue is deleted when it holds no message and has no consumer; one that still
  holds tasks is kept, and said so. Quorum queues refuse ``queue.delete`` with ``if-empty``,
  so the count is read just before the delete: a per-handler delay queue's only way in, its
  fanout exchange, is deleted first; the per-lane ones and the lanes were published to by
  name, so run migrate once no worker or producer of an older version runs (one that still
  writes between the count and the delete is logged as an error with the count);
- an old lane of a handler that takes no priorities is consumed by no worker of this version:
  its tasks are moved to Q (each published with a confirm, then acked: a crash in between
  leaves a duplicate, which the idempotency guard absorbs, never a loss), then it is deleted
  like the delay queues; while an old delay queue of the handler remains, the lane is kept
  (that queue may still return tasks to it).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

from aio_pika.abc import AbstractConnection
from pamqp.commands import Basic

from weclaw_mq.admin.dlq_message import kept_properties
from weclaw_mq.admin.dlq_pass import connected, ready_count
from weclaw_mq.admin.queue_stats import older_delay_queues
from weclaw_mq.app import App
from weclaw_mq.contract.naming import is_shared_name, lane_queue_name
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.policy.limits import DEFER_LADDER_MS
from weclaw_mq.policy.priority import Priority

log = logging.getLogger("weclaw_mq.migrate")


@dataclass(frozen=True)
class Kept:
    name: str
    messages: int
    why: str


@dataclass
class MigrateSummary:
    deleted: list[str] = field(default_factory=list)
    # Tasks moved from an old lane to its handler queue, per lane.
    moved: dict[str, int] = field(default_factory=dict)
    kept: list[Kept] = field(default_factory=list)


async def _delete_if_empty(conn: AbstractConnection, name: str) -> bool:
    """Delete ``name`` if it has no consumer and no message; False when not. Quorum queues
    refuse ``if-empty`` and ``if-unused``, so the counts are read just before; the fanout
    exchange in front of a per-handler delay queue (its only way in) goes first. Never one of
    the vhost's shared queues: other apps use them (``naming.is_shared_name``)."""
    if is_shared_name(name):
        log.error("migrate does not delete %s: the vhost's shared queues serve every app", name)
        return False
    await _delete_exchange(conn, name)
    counts = await ready_count(conn, name)
    if counts is None or counts != (0, 0):
        return False
    channel = await conn.channel()
    try:
        deleted = await channel.queue_delete(name)
    finally:
        if not channel.is_closed:
            await channel.close()
    if deleted.message_count:  # published between the count and the delete: say so
        log.error(
            "%s received %d message(s) while migrate deleted it: a worker or producer of "
            "an older version is still running (stop them before migrating)",
            name,
            deleted.message_count,
        )
    return True


async def _delete_exchange(conn: AbstractConnection, name: str) -> None:
    """The per-handler delay queue's fanout exchange of the same name (none: no error)."""
    channel = await conn.channel()
    try:
        await channel.exchange_delete(name)
    finally:
        if not channel.is_closed:
            await channel.close()


async def _move_all(conn: AbstractConnection, source: str, target: str) -> int:
    """Move every ready task of ``source`` to ``target``: copy confirmed, then ack."""
    channel = await conn.channel(publisher_confirms=True)
    moved = 0
    try:
        raw = await channel.get_underlay_channel()
        while True:
            got = await raw.basic_get(source, no_ack=False)
            if not isinstance(got.delivery, Basic.GetOk):
                return moved
            confirm = await raw.basic_publish(
                got.body,
                exchange="",
                routing_key=target,
                properties=kept_properties(got.header.properties),
                mandatory=True,
            )
            if not isinstance(confirm, Basic.Ack):
                return moved  # the unacked original goes back to its lane on close
            await raw.basic_ack(got.delivery.delivery_tag or 0)
            moved += 1
    finally:
        with contextlib.suppress(Exception):
            if not channel.is_closed:
                await channel.close()


def _delays_of(app: App, queue: str) -> list[int]:
    spec = app.handlers[queue].queue_spec()
    return sorted({*STEP_DELAYS_MS, *DEFER_LADDER_MS, *spec.retry_delays_ms})


async def migrate(app: App) -> MigrateSummary:
    """Delete the empty queues older versions left for ``app``'s handlers (see above)."""
    summary = MigrateSummary()
    async with connected(app, "migrate") as conn:
        for queue, spec in app.handlers.items():
            waiting = False
            for name in older_delay_queues(queue, _delays_of(app, queue)):
                counts = await ready_count(conn, name)
                if counts is None:
                    continue
                if await _delete_if_empty(conn, name):
                    summary.deleted.append(name)
                else:
                    waiting = True
                    summary.kept.append(
                        Kept(
                            name,
                            counts[0],
                            "not empty: its tasks return to their lane as their delays end; "
                            "run migrate again after the longest delay",
                        )
                    )
            if spec.priorities:
                continue
            for level in (Priority.HIGH, Priority.URGENT):
                lane = lane_queue_name(queue, level.value)
                counts = await ready_count(conn, lane)
                if counts is None:
                    continue
                if waiting:
                    summary.kept.append(
                        Kept(
                            lane,
                            counts[0],
                            "an old delay queue of its handler may still return tasks here",
                        )
                    )
                    continue
                if moved := await _move_all(conn, lane, queue):
                    summary.moved[lane] = moved
                    log.info("moved %d task(s) from %s to %s", moved, lane, queue)
                if await _delete_if_empty(conn, lane):
                    summary.deleted.append(lane)
                else:
                    left = await ready_count(conn, lane)
                    summary.kept.append(
                        Kept(
                            lane,
                            left[0] if left else 0,
                            "still consumed (a worker of an older version?) or not empty",
                        )
                    )
    return summary

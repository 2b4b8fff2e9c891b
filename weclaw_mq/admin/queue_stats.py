"""Queue depths: ready messages and consumers of a handler queue, its priority lanes, the
shared delay queues it uses, the queues an older version left, and the DLQ.

Two ways to know which queues a handler has: from its spec (``--app``: ``stats`` with the
handler's own delays), or from the broker alone (``discover``). AMQP 0-9-1 cannot list
queues, so ``discover`` passive-declares every name the library itself can give a handler
queue (``weclaw_mq.contract.naming``): its lanes, and the delay queues of the step delays
(``delays.STEP_DELAYS_MS``), the limit ladder (``limits.DEFER_LADDER_MS``) and the retry
policy the ``WECLAW_MQ_*`` settings give; those that exist are the handler's. A delay queue of
a handler's own ``RetryPolicy`` outside those sets is only found with ``--app``.

Roles: ``work``, ``lane``, ``ladder`` (a delay queue of the vhost's shared ladder: its count is
every handler's tasks waiting there), ``old`` (a queue of an older version: the per-handler
``Q.retry.lanes.<delay>``, the per-lane ``Q.retry.<delay>`` / ``Q.lane.high.retry.<delay>``,
or a lane of a handler that no longer takes priorities; listed only while it exists, what
it holds still comes back to its lane, and ``weclaw-mq migrate`` deletes it once empty) and
``dlq``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from aio_pika.abc import AbstractConnection

from weclaw_mq.admin.dlq_pass import connected, ready_count
from weclaw_mq.app import App
from weclaw_mq.contract.naming import (
    delay_queue_name,
    dlq_name,
    ladder_queue_name,
    lane_queue_name,
    retry_queue_name,
)
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.policy.limits import DEFER_LADDER_MS
from weclaw_mq.policy.priority import Priority, route
from weclaw_mq.wire.connection import server_version


@dataclass(frozen=True)
class QueueCount:
    name: str
    role: str  # "work", "lane", "ladder", "old" or "dlq"
    exists: bool
    messages: int | None  # ready only: messages a consumer holds unacked are not counted
    consumers: int | None


@dataclass(frozen=True)
class QueueStats:
    queue: str
    work: QueueCount
    retries: tuple[QueueCount, ...]
    dlq: QueueCount
    # The HIGH and URGENT lanes (none without priorities or where the broker has native
    # ones). ``retries``: the shared delay queues Q's tasks wait in.
    lanes: tuple[QueueCount, ...] = ()
    # What an older version left: delay queues per handler or per lane, unused lanes.
    old: tuple[QueueCount, ...] = ()

    @property
    def all(self) -> tuple[QueueCount, ...]:
        return (self.work, *self.lanes, *self.retries, *self.old, self.dlq)

    def as_json(self) -> dict[str, object]:
        """``stats --json``: stable keys, one entry per queue in ``all``'s order."""
        return {
            "queue": self.queue,
            "queues": [
                {
                    "name": c.name,
                    "role": c.role,
                    "exists": c.exists,
                    "ready": c.messages,
                    "consumers": c.consumers,
                }
                for c in self.all
            ],
        }


def _missing(queue: str) -> ConfigurationError:
    return ConfigurationError(
        f"no queue named {queue!r} on the broker (a handler's queues are declared by "
        "'weclaw-mq declare MODULE:APP' or its worker)"
    )


def older_delay_queues(queue: str, delays_ms: Iterable[int]) -> list[str]:
    """Every delay queue an older version may have given handler queue ``queue`` for these
    delays: the per-handler ``Q.retry.lanes.<delay>``, then the per-lane ones."""
    delays = list(dict.fromkeys(delays_ms))
    lanes = [queue, *(lane_queue_name(queue, p.value) for p in (Priority.HIGH, Priority.URGENT))]
    names = [delay_queue_name(queue, d) for d in delays]
    return names + [retry_queue_name(lane, d) for lane in lanes for d in delays]


async def stats(app: App, queue: str, *, retry_delays_ms: Iterable[int] = ()) -> QueueStats:
    """Message and consumer counts of ``Q``, its lanes, the shared delay queues of
    ``retry_delays_ms`` and ``Q.dlq``; a queue that does not exist is reported absent
    (passive declares never create anything). An older version's queue is listed (``old``)
    where it exists."""
    async with connected(app, "stats") as conn:
        return await stats_on(conn, app, queue, retry_delays_ms=retry_delays_ms)


async def stats_on(
    conn: AbstractConnection, app: App, queue: str, *, retry_delays_ms: Iterable[int] = ()
) -> QueueStats:
    """``stats`` on an open connection: for a caller that counts several handlers' queues
    at once (the web console's overview), one connection for all."""
    if await ready_count(conn, queue) is None:
        raise _missing(queue)

    async def count(name: str, role: str) -> QueueCount:
        counts = await ready_count(conn, name)
        if counts is None:
            return QueueCount(name, role, exists=False, messages=None, consumers=None)
        return QueueCount(name, role, exists=True, messages=counts[0], consumers=counts[1])

    version = server_version(conn)
    spec = app.handlers.get(queue)
    takes = spec is None or spec.priorities
    lane_names = [
        route(queue, level, version, app.queue_type_of(queue))[0]
        for level in (Priority.HIGH, Priority.URGENT)
    ]
    lane_names = [name for name in lane_names if name != queue] if takes else []
    if spec is not None and spec.fair is not None:  # its priority lanes, then its fair lanes
        lane_names = [name for name in spec.queue_spec().lane_queues(version) if name != queue]
    work = await count(queue, "work")
    lanes = [await count(name, "lane") for name in lane_names]
    delays = list(dict.fromkeys(retry_delays_ms))
    retries = [await count(ladder_queue_name(d), "ladder") for d in delays]
    old_names = older_delay_queues(queue, delays)
    if not takes:  # lanes of a handler that no longer takes priorities
        old_names += [lane_queue_name(queue, p.value) for p in (Priority.HIGH, Priority.URGENT)]
    old = [c for name in old_names if (c := await count(name, "old")).exists]
    dlq = await count(dlq_name(queue), "dlq")
    return QueueStats(queue, work, tuple(retries), dlq, tuple(lanes), tuple(old))


def handler_retry_delays_ms(app: App, queue: str) -> tuple[int, ...]:
    """The delays whose queues ``queue``'s handler declares: from its spec when ``app`` has
    one, else what a handler registered without retry options would get from settings."""
    spec = app.handlers.get(queue)
    if spec is None:
        # A stand-in on a scratch App: App.handler's defaults and the spec's delay rules stay
        # in one place instead of being copied here.
        scratch = App(f"{app.name}-stats", settings=app.settings)

        async def stand_in(task: object) -> None:
            return None

        scratch.handler(queue)(stand_in)
        spec = scratch.handlers[queue]
    return spec.queue_spec().retry_delays_ms


async def discover(app: App, queue: str) -> QueueStats:
    """Counts of the queues of handler queue ``queue`` that exist on the broker, found by
    name (see the module's docstring); ``ConfigurationError`` if ``queue`` does not exist.
    Only existing queues are listed, except the DLQ, which every handler has."""
    delays = sorted({*STEP_DELAYS_MS, *DEFER_LADDER_MS, *handler_retry_delays_ms(app, queue)})
    async with connected(app, "stats") as conn:

        async def found(name: str, role: str) -> QueueCount | None:
            counts = await ready_count(conn, name)
            if counts is None:
                return None
            return QueueCount(name, role, exists=True, messages=counts[0], consumers=counts[1])

        work = await found(queue, "work")
        if work is None:
            raise _missing(queue)
        lanes = [
            lane
            for level in (Priority.HIGH, Priority.URGENT)
            if (lane := await found(lane_queue_name(queue, level.value), "lane")) is not None
        ]
        retries = [
            ladder
            for d in delays
            if (ladder := await found(ladder_queue_name(d), "ladder")) is not None
        ]
        old = [c for name in older_delay_queues(queue, delays) if (c := await found(name, "old"))]
        dlq = await found(dlq_name(queue), "dlq") or QueueCount(
            dlq_name(queue), "dlq", exists=False, messages=None, consumers=None
        )
    return QueueStats(queue, work, tuple(retries), dlq, tuple(lanes), tuple(old))

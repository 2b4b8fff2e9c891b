"""Queue depths: ready messages and consumers of a handler queue, its priority lanes, their
delay queues and the DLQ.

Two ways to know which queues a handler has: from its spec (``--app``: ``stats`` with the
handler's own delays), or from the broker alone (``discover``). AMQP 0-9-1 cannot list
queues, so ``discover`` passive-declares every name the library itself can give a handler
queue (``weclaw_mq.naming``): its lanes, and the delay queues of the step delays
(``delays.STEP_DELAYS_MS``), the limit ladder (``limits.DEFER_LADDER_MS``) and the retry
policy the ``WECLAW_MQ_*`` settings give; those that exist are the handler's. A delay queue of
a handler's own ``RetryPolicy`` outside those sets is only found with ``--app``.

Delay queues: Q's shared ones (``Q.retry.lanes.<delay>``), then the per-lane ones of older
versions (``Q.retry.<delay>``, ``Q.lane.high.retry.<delay>``, ...) where an upgraded
deployment still has them: those are listed only when they exist (what they hold still comes
back to its lane).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..app import App
from ..delays import STEP_DELAYS_MS
from ..errors import ConfigurationError
from ..limits import DEFER_LADDER_MS
from ..naming import delay_queue_name, dlq_name, lane_queue_name, retry_queue_name
from ..priority import Priority, route
from ..publishing.connection import server_version
from .dlq import connected, ready_count


@dataclass(frozen=True)
class QueueCount:
    name: str
    role: str  # "work", "lane", "retry" or "dlq"
    exists: bool
    messages: int | None  # ready only: messages a consumer holds unacked are not counted
    consumers: int | None


@dataclass(frozen=True)
class QueueStats:
    queue: str
    work: QueueCount
    retries: tuple[QueueCount, ...]
    dlq: QueueCount
    # The HIGH and URGENT lanes (none where the broker has native priorities). ``retries``:
    # Q's delay queues (shared by its lanes), then any per-lane one of an older version.
    lanes: tuple[QueueCount, ...] = ()

    @property
    def all(self) -> tuple[QueueCount, ...]:
        return (self.work, *self.lanes, *self.retries, self.dlq)

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


async def stats(app: App, queue: str, *, retry_delays_ms: Iterable[int] = ()) -> QueueStats:
    """Message and consumer counts of ``Q``, its lanes, each ``Q.retry.lanes.<delay>`` and
    ``Q.dlq``; a queue that does not exist is reported absent (passive declares never create
    anything). An older version's per-lane delay queue is listed where it exists."""
    async with connected(app, "stats") as conn:
        if await ready_count(conn, queue) is None:
            raise _missing(queue)

        async def count(name: str, role: str) -> QueueCount:
            counts = await ready_count(conn, name)
            if counts is None:
                return QueueCount(name, role, exists=False, messages=None, consumers=None)
            return QueueCount(name, role, exists=True, messages=counts[0], consumers=counts[1])

        version = server_version(conn)
        lane_names = [
            route(queue, level, version, app.queue_type_of(queue))[0]
            for level in (Priority.HIGH, Priority.URGENT)
        ]
        lane_names = [name for name in lane_names if name != queue]
        work = await count(queue, "work")
        lanes = [await count(name, "lane") for name in lane_names]
        delays = list(dict.fromkeys(retry_delays_ms))
        retries = [await count(delay_queue_name(queue, d), "retry") for d in delays]
        retries += [
            old
            for lane in (queue, *lane_names)
            for d in delays
            if (old := await count(retry_queue_name(lane, d), "retry")).exists
        ]
        dlq = await count(dlq_name(queue), "dlq")
    return QueueStats(queue, work, tuple(retries), dlq, tuple(lanes))


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
        names = [delay_queue_name(queue, d) for d in delays]
        names += [retry_queue_name(source.name, d) for source in (work, *lanes) for d in delays]
        retries = [retry for name in names if (retry := await found(name, "retry")) is not None]
        dlq = await found(dlq_name(queue), "dlq") or QueueCount(
            dlq_name(queue), "dlq", exists=False, messages=None, consumers=None
        )
    return QueueStats(queue, work, tuple(retries), dlq, tuple(lanes))

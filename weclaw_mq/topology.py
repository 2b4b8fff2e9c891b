"""The queues of one handler and their arguments, declared idempotently.

For a handler queue ``Q`` (names from ``naming``):

| queue                 | type   | arguments                                                |
|-----------------------|--------|----------------------------------------------------------|
| Q                     | quorum | dead-letter to Q.dlq (at-least-once, reject-publish),    |
|                       |        | delivery limit, optional max length                      |
| Q.retry.lanes.<delay> | quorum | x-message-ttl = delay, dead-letter to the default        |
|                       |        | exchange by the message's OWN routing key (at-least-once)|
|                       |        | one per policy delay and per step of                     |
|                       |        | ``delays.STEP_DELAYS_MS``; a fanout exchange of the same |
|                       |        | name is bound to it                                      |
| Q.dlq                 | quorum | nothing expires or overflows there; from RabbitMQ 4.0 on,|
|                       |        | the default delivery limit turned off (x-delivery-limit  |
|                       |        | -1)                                                      |

Priorities (``priority.plan_priorities``): where the broker has none usable, the HIGH and
URGENT levels get lanes ``Q.lane.high`` / ``Q.lane.urgent``, each declared like Q (dead-letter
to the one Q.dlq). The lanes SHARE Q's delay queues: a task is parked by publishing it to the
delay queue's fanout exchange with its lane as routing key; the fanout ignores the key, and
the delay queue, declared without x-dead-letter-routing-key, dead-letters it through the
default exchange by that same key: back to its lane. So a handler has 1 + levels + delays
quorum queues (13 by default on RabbitMQ 3.x, 18 with ``limit=``), not levels x (1 + delays)
+ 1 (31 and 46): each quorum queue holds ~3 of the broker's file handles (measured on 3.10.8),
and a broker at ``ulimit -n 1024`` has 927, past which it accepts no new connection. The
number stays fixed whatever delays ``Retry(after_s=)`` and ``publish(delay_s=)`` ask for
(``weclaw_mq.delays``).

Why per handler, not one set per vhost: a quorum queue's at-least-once dead-lettering keeps a
message whose target queue no longer exists in the source queue and retries it forever
(measured on 3.10.8: it stayed there, never cleaned). A vhost-wide delay queue would collect
the tasks of every deleted handler; a handler's own ones go with it.

Versions before these kept one set of delay queues per lane (``Q.retry.<delay>``,
``Q.lane.high.retry.<delay>``, dead-lettering to their lane by x-dead-letter-routing-key).
They are no longer declared nor published to; what an upgraded deployment still holds in
them comes back to its lane as before (``naming.retry_queue_name``).

A ``queue_type="classic"`` handler queue is classic with ``x-max-priority`` (classic queues
refuse ``x-delivery-limit`` and the at-least-once dead-letter strategy, so it has neither);
its delay queues and DLQ stay quorum.

What differs by broker version is decided in ``broker_version.dlq_plan``.

A handler with ``notify=`` also declares its results queue ``R`` (``Q.results`` or the name it
gave) and ``R.dlq``, with exactly the arguments of a handler queue with default options: its
consumer (the notification service) is a handler on ``R`` and declares the same queue. ``R``
may already exist with other arguments (its handler's own options, or ops's): it is then kept
as it is, never a conflict.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import aiormq
from aio_pika import ExchangeType
from aio_pika.abc import AbstractChannel

from .broker_version import ServerVersion, dlq_plan
from .errors import ConfigurationError, TopologyConflictError
from .naming import delay_queue_name, dlq_name, lane_queue_name
from .priority import CLASSIC, QUORUM, plan_priorities
from .publishing.connection import channel_server_version

log = logging.getLogger(__name__)

# All routing goes through the default exchange: a queue's name is its routing key, so a
# missing queue shows up as an unroutable (returned) publish rather than a closed channel.
DEFAULT_EXCHANGE = ""


@dataclass(frozen=True)
class QueueSpec:
    name: str
    retry_delays_ms: tuple[int, ...]
    # Without a dead-letter exchange RabbitMQ 3.10 silently DROPS a message that reaches the
    # delivery limit, so the limit is only ever set together with the DLQ routing below.
    delivery_limit: int
    max_length: int | None = None
    # The handler's results queue (notify=), declared with default handler-queue arguments.
    results: QueueSpec | None = None
    queue_type: str = QUORUM

    def lane_queues(self, version: ServerVersion | None) -> list[str]:
        """Q and its lane queues on ``version``, highest priority first."""
        plan = plan_priorities(version, self.queue_type)
        return [lane_queue_name(self.name, level.value) for level in plan.lanes]


def _quorum_dead_lettering(target: str | None) -> dict[str, object]:
    """Dead-lettering through the default exchange to ``target``, or (None) to the queue the
    message's own routing key names."""
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DEFAULT_EXCHANGE,
        **({} if target is None else {"x-dead-letter-routing-key": target}),
        # at-least-once keeps the message in the source until the target confirmed it;
        # RabbitMQ requires reject-publish overflow for that strategy.
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


def work_queue_arguments(spec: QueueSpec) -> dict[str, object]:
    if spec.queue_type == CLASSIC:
        args: dict[str, object] = {
            "x-queue-type": CLASSIC,
            "x-dead-letter-exchange": DEFAULT_EXCHANGE,
            "x-dead-letter-routing-key": dlq_name(spec.name),
            "x-overflow": "reject-publish",
            **plan_priorities(None, CLASSIC).queue_arguments,
        }
    else:
        args = _quorum_dead_lettering(dlq_name(spec.name))
        args["x-delivery-limit"] = spec.delivery_limit
    if spec.max_length is not None:
        args["x-max-length"] = spec.max_length
    return args


def delay_queue_arguments(delay_ms: int) -> dict[str, object]:
    """A delay queue shared by a handler's lanes. One queue per delay: RabbitMQ expires
    messages only at the head of a queue, so mixed per-message delays in one queue would hold
    short delays behind long ones. No x-dead-letter-routing-key: an expired message goes back
    by the routing key it was published with, its lane (``Settler``, ``App._route``)."""
    args = _quorum_dead_lettering(None)
    args["x-message-ttl"] = delay_ms
    return args


def delay_exchanges(spec: QueueSpec) -> list[str]:
    """The fanout exchanges of ``spec``'s delay queues, each named as (and bound to) its
    queue; exchanges hold no file handle on the broker."""
    return [delay_queue_name(spec.name, d) for d in spec.retry_delays_ms]


def dlq_arguments(version: ServerVersion | None = None) -> dict[str, object]:
    return {"x-queue-type": "quorum", **dlq_plan(version).extra_arguments}


def queue_declarations(
    spec: QueueSpec, version: ServerVersion | None = None
) -> list[tuple[str, dict[str, object]]]:
    """Every (name, arguments) of one handler; the DLQ first, as the dead-letter target; the
    results queue (if any) last."""
    return _own_declarations(spec, version) + results_queue_declarations(spec, version)


def _own_declarations(
    spec: QueueSpec, version: ServerVersion | None
) -> list[tuple[str, dict[str, object]]]:
    decls: list[tuple[str, dict[str, object]]] = [(dlq_name(spec.name), dlq_arguments(version))]
    # Q first (the NORMAL lane), then the higher lanes, then the delay queues they share.
    for lane in reversed(spec.lane_queues(version)):
        decls.append((lane, work_queue_arguments(spec)))
    for delay_ms in spec.retry_delays_ms:
        decls.append((delay_queue_name(spec.name, delay_ms), delay_queue_arguments(delay_ms)))
    return decls


def results_queue_declarations(
    spec: QueueSpec, version: ServerVersion | None = None
) -> list[tuple[str, dict[str, object]]]:
    """The results queue of a handler with ``notify=`` and its DLQ; none without."""
    if spec.results is None:
        return []
    results = spec.results
    return [
        (dlq_name(results.name), dlq_arguments(version)),
        (results.name, work_queue_arguments(results)),
    ]


_INEQUIVALENT_ARG = re.compile(r"inequivalent arg '([^']+)'")


async def declare(
    channel: AbstractChannel,
    specs: Iterable[QueueSpec],
    *,
    server_version: ServerVersion | None = None,
) -> list[str]:
    """Declare every queue of ``specs``; returns their names. Safe to run again and again.

    A conflict closes ``channel`` (AMQP's rule), so callers open a fresh one afterwards.
    The broker's version is read from ``channel`` unless ``server_version`` says it.
    """
    version = server_version or await channel_server_version(channel)
    specs = list(specs)
    declared: list[str] = []
    for spec in specs:
        for name, args in _own_declarations(spec, version):
            try:
                await channel.declare_queue(name, durable=True, arguments=args)  # type: ignore[arg-type]
            except aiormq.exceptions.ChannelAccessRefused:
                await _check_exists(channel, name)
            except aiormq.exceptions.ChannelPreconditionFailed as e:
                text = str(e)
                match = _INEQUIVALENT_ARG.search(text)
                argument = match.group(1) if match else None
                if name == dlq_name(spec.name) and argument in dlq_plan(version).extra_arguments:
                    await _declare_older_dlq(channel, name, version)
                else:
                    raise TopologyConflictError(name, argument, text) from e
            declared.append(name)
        for exchange in delay_exchanges(spec):
            await _declare_delay_exchange(channel, exchange)
    # Results queues last: one that is also a handler queue here was declared above with that
    # handler's own options, which win over the defaults.
    for spec in specs:
        for name, args in results_queue_declarations(spec, version):
            if name not in declared:
                await _declare_or_keep(channel, name, args)
                declared.append(name)
    return declared


async def _declare_delay_exchange(channel: AbstractChannel, name: str) -> None:
    """The fanout exchange in front of delay queue ``name``, bound to it. Without configure
    permission (a least-privilege worker) it must exist already: an operator's
    ``weclaw-mq declare`` made it, and its binding."""
    try:
        exchange = await channel.declare_exchange(name, ExchangeType.FANOUT, durable=True)
    except aiormq.exceptions.ChannelAccessRefused:
        await channel.reopen()
        try:
            await channel.declare_exchange(name, ExchangeType.FANOUT, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as e:
            raise ConfigurationError(
                f"exchange {name!r} does not exist and this user may not declare it (no "
                "configure permission): run 'weclaw-mq declare MODULE:APP' as an operator first"
            ) from e
        return
    # Binding again is a no-op (the queue was declared just before, under the same name). A
    # fanout ignores the binding's key: "" says so.
    queue = await channel.get_queue(name, ensure=False)
    await queue.bind(exchange, routing_key="")


async def _check_exists(channel: AbstractChannel, name: str) -> None:
    """A user without configure permission (a least-privilege worker, see ``permissions``)
    may not declare, not even a queue that exists as asked; a passive declare needs no
    permission and says whether it exists. Its arguments are then the operator's, set by
    ``weclaw-mq declare``."""
    await channel.reopen()
    try:
        await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity as e:
        raise ConfigurationError(
            f"queue {name!r} does not exist and this user may not declare it (no configure "
            "permission): run 'weclaw-mq declare MODULE:APP' as an operator first"
        ) from e
    log.debug("using %s as declared by an operator (no configure permission)", name)


async def _declare_or_keep(channel: AbstractChannel, name: str, args: dict[str, object]) -> None:
    """Declare a results queue, or keep the one that exists with other arguments: they were
    chosen by its consumer's handler options or by ops (a max length, say), and a declare
    never changes a queue's arguments anyway."""
    try:
        await channel.declare_queue(name, durable=True, arguments=args)  # type: ignore[arg-type]
    except aiormq.exceptions.ChannelAccessRefused:
        await _check_exists(channel, name)
    except aiormq.exceptions.ChannelPreconditionFailed as e:
        await channel.reopen()
        await channel.declare_queue(name, passive=True)
        log.info("results queue %s exists with other arguments; kept as it is (%s)", name, e)


async def _declare_older_dlq(
    channel: AbstractChannel, name: str, version: ServerVersion | None
) -> None:
    """A DLQ declared before its broker imposed a default delivery limit (an upgrade to 4.0
    or newer): keep it as it is, and say how to turn the limit off. Our looks never hand a
    message back, so it only matters to other readers of the DLQ."""
    await channel.reopen()
    await channel.declare_queue(name, durable=True, arguments=dlq_arguments(None))  # type: ignore[arg-type]
    log.warning(
        "%s was declared before RabbitMQ %s gave quorum queues a default delivery limit: a "
        "message handed back to it %d times is dropped. Turn the limit off with: %s",
        name,
        version,
        dlq_plan(version).default_delivery_limit,
        dlq_plan(version).policy_hint(name),
    )

"""The queues of one handler, the vhost's shared delay ladder, and their arguments, declared
idempotently.

For a handler queue ``Q`` (names from ``naming``):

| queue                 | type   | arguments                                                |
|-----------------------|--------|----------------------------------------------------------|
| Q                     | quorum | dead-letter to Q.dlq (at-least-once, reject-publish),    |
|                       |        | delivery limit, optional max length; bound to the return |
|                       |        | exchange by its own name                                 |
| Q.dlq                 | quorum | nothing expires or overflows there; from RabbitMQ 4.0 on,|
|                       |        | the default delivery limit turned off (x-delivery-limit  |
|                       |        | -1)                                                      |

Priorities are opt-in (``priorities=True``, or a default priority above NORMAL): only such a
handler gets, where the broker has none usable (``priority.plan_priorities``), the lanes
``Q.lane.high`` / ``Q.lane.urgent``, each declared and bound like Q (dead-letter to the one
Q.dlq). Opt-in rather than on a first HIGH publish: a producer's first URGENT task must not
need a queue that no one has declared yet. A plain handler is 2 quorum queues on every
version, one with priorities 4 on 3.x - 4.2 and 2 on 4.3.

Shared by every handler of the vhost (``ladder_declarations``):

| name                       | kind            | what                                         |
|----------------------------|-----------------|----------------------------------------------|
| weclaw_mq.delay.<delay>    | quorum + fanout | x-message-ttl = delay; dead-letters (at-     |
|                            |                 | least-once) to weclaw_mq.return WITHOUT a    |
|                            |                 | dead-letter routing key: by the task's own   |
| weclaw_mq.return           | direct exchange | each work queue and lane bound by its name;  |
|                            |                 | alternate exchange weclaw_mq.unroutable      |
| weclaw_mq.unroutable       | fanout exchange | bound to the parking queue                   |
| weclaw_mq.unroutable.dlq   | quorum          | the parking queue, read by the DLQ tools     |

A retried, deferred or delayed task is published to the fanout exchange of the delay queue
with its lane as routing key (``worker.settle``, ``PublishingEngine._route``); on expiry it is
dead-lettered through the return exchange by that key, back to its lane. One delay queue per
delay value on the vhost (the step queues of ``delays.STEP_DELAYS_MS``, the limits' deferral
ladder, and each distinct retry-policy delay), whatever the number of handlers: RabbitMQ
expires messages only at the head of a queue, so one delay needs one queue, but not one per
handler. Each quorum queue holds ~3 of the broker's file handles (measured on 3.10.8).

Why the return exchange and its alternate exchange: a quorum queue's at-least-once
dead-lettering keeps a message whose target no longer exists in the source and retries it
forever (measured on 3.10.8). Routed through an exchange, a task whose queue was deleted
matches no binding and goes to the alternate exchange: it lands in the parking queue, where
``weclaw-mq dlq list weclaw_mq.unroutable`` shows it (measured on 3.10.8: at-least-once
dead-lettering honours the alternate exchange; ``tests/drills/test_file_handles_drill.py``).

Older versions kept delay queues per handler (``Q.retry.lanes.<delay>``) or per lane
(``Q.retry.<delay>``), dead-lettering through the default exchange. They are no longer
declared nor published to; what an upgraded deployment still holds in them comes back to its
lane as before, ``weclaw-mq stats`` shows them and ``weclaw-mq migrate`` deletes them once
empty (``admin.migrate``).

A ``queue_type="classic"`` handler queue is classic with ``x-max-priority`` (classic queues
refuse ``x-delivery-limit`` and the at-least-once dead-letter strategy, so it has neither);
its DLQ stays quorum.

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
from typing import Any

import aiormq
from aio_pika import ExchangeType
from aio_pika.abc import AbstractChannel

from weclaw_mq.contract.naming import (
    DLQ_SUFFIX,
    MIDNIGHT_QUEUE,
    RETURN_EXCHANGE,
    UNROUTABLE,
    dlq_name,
    fair_lane_name,
    ladder_queue_name,
    lane_queue_name,
    parking_queue_name,
)
from weclaw_mq.errors import ConfigurationError, TopologyConflictError
from weclaw_mq.policy.broker_version import ServerVersion, dlq_plan
from weclaw_mq.policy.priority import CLASSIC, QUORUM, Priority, plan_priorities
from weclaw_mq.wire.connection import channel_server_version

log = logging.getLogger("weclaw_mq.topology")

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
    # Takes priorities (``priorities=True``): lanes where the broker has none usable.
    priorities: bool = False
    # The queues of its NORMAL level (``fair=``: Q and ``Q.lane.f<i>``; 1: Q alone).
    fair_lanes: int = 1
    # Parks tasks until the next UTC midnight (a ``Cap(action="park")``): the vhost's
    # midnight queue is declared for it.
    parks_until_midnight: bool = False

    def lane_queues(self, version: ServerVersion | None) -> list[str]:
        """Q and its lane queues on ``version``, highest priority first, Q last (Q alone for
        a handler without priorities or fair share); the fair lanes are the NORMAL level."""
        return [lane for lane, _ in self.lane_levels(version)]

    def lane_levels(self, version: ServerVersion | None) -> list[tuple[str, int]]:
        """``lane_queues`` each with its level's rank (0 highest): the lanes of one level (the
        fair lanes) share a rank and are served in turn (``policy.fair_share``)."""
        fair = self.fair_lanes > 1
        levels: tuple[Priority, ...] = (Priority.NORMAL,)
        if self.priorities:
            levels = plan_priorities(version, self.queue_type, fair=fair).lanes
        upper = [
            (lane_queue_name(self.name, level.value), rank)
            for rank, level in enumerate(levels[:-1])
        ]
        normal = [fair_lane_name(self.name, i) for i in (*range(1, self.fair_lanes), 0)]
        return upper + [(lane, len(upper)) for lane in normal]


def _quorum_dead_lettering(target: str | None) -> dict[str, object]:
    """Dead-lettering through the default exchange to ``target``, or (None) through the
    return exchange by the message's own routing key."""
    return {
        "x-queue-type": "quorum",
        **(
            {"x-dead-letter-exchange": RETURN_EXCHANGE}
            if target is None
            else {"x-dead-letter-exchange": DEFAULT_EXCHANGE, "x-dead-letter-routing-key": target}
        ),
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
    """A delay queue of the vhost's shared ladder. One queue per delay: RabbitMQ expires
    messages only at the head of a queue, so mixed per-message delays in one queue would hold
    short delays behind long ones. No x-dead-letter-routing-key: an expired message goes back
    through the return exchange by the routing key it was published with, its lane
    (``Settler``, ``PublishingEngine._route``); a lane that is gone matches no binding and the
    return exchange's alternate exchange parks the task."""
    args = _quorum_dead_lettering(None)
    args["x-message-ttl"] = delay_ms
    return args


def midnight_queue_arguments() -> dict[str, object]:
    """The vhost's midnight queue: as a delay queue, but each message carries its own TTL
    (``expiration``: until the next UTC midnight), all due at the same instant."""
    return _quorum_dead_lettering(None)


def delay_exchanges(spec: QueueSpec) -> list[str]:
    """The fanout exchanges of the shared delay queues ``spec`` publishes to, each named as
    (and bound to) its queue; exchanges hold no file handle on the broker. Shared by every
    handler of the vhost: never deleted with one."""
    midnight = [MIDNIGHT_QUEUE] if spec.parks_until_midnight else []
    return [ladder_queue_name(d) for d in spec.retry_delays_ms] + midnight


def ladder_delays_ms(specs: Iterable[QueueSpec]) -> list[int]:
    """Every delay (ms) the shared ladder needs for ``specs``, shortest first."""
    return sorted({d for spec in specs for d in spec.retry_delays_ms})


def ladder_declarations(
    specs: Iterable[QueueSpec], version: ServerVersion | None = None
) -> list[tuple[str, dict[str, object]]]:
    """The shared queues ``specs`` need: the parking queue first, then one delay queue per
    delay. The same names and arguments for every app of a vhost, so declaring is no
    conflict; nobody deletes them per handler."""
    specs = list(specs)
    decls: list[tuple[str, dict[str, object]]] = [(parking_queue_name(), dlq_arguments(version))]
    for delay_ms in ladder_delays_ms(specs):
        decls.append((ladder_queue_name(delay_ms), delay_queue_arguments(delay_ms)))
    if any(spec.parks_until_midnight for spec in specs):
        decls.append((MIDNIGHT_QUEUE, midnight_queue_arguments()))
    return decls


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
    # Q first (the NORMAL lane), then the higher lanes (the delay queues are the vhost's).
    for lane in reversed(spec.lane_queues(version)):
        decls.append((lane, work_queue_arguments(spec)))
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


class DeclaredQueues(list[str]):
    """What ``declare`` declared. The list itself: the app's own queues (its handlers' queues,
    DLQs, lanes and results queues), safe to delete with the app. Apart, ``shared``: the
    vhost's delay ladder and parking queue, which every other app of the vhost uses too."""

    def __init__(self, own: Iterable[str] = (), shared: Iterable[str] = ()) -> None:
        super().__init__(own)
        self.shared: tuple[str, ...] = tuple(shared)

    @property
    def own(self) -> tuple[str, ...]:
        """The app's own queues (the list's items)."""
        return tuple(self)


async def declare(
    channel: AbstractChannel,
    specs: Iterable[QueueSpec],
    *,
    server_version: ServerVersion | None = None,
) -> DeclaredQueues:
    """Declare every queue of ``specs``; returns their names, the app's own apart from the
    vhost's shared ones. Safe to run again and again.

    A conflict closes ``channel`` (AMQP's rule), so callers open a fresh one afterwards.
    The broker's version is read from ``channel`` unless ``server_version`` says it.
    """
    version = server_version or await channel_server_version(channel)
    specs = list(specs)
    declared: list[str] = []
    shared: list[str] = []
    # The shared ladder first: the exchanges the handlers' queues are bound to.
    await _declare_exchange(channel, UNROUTABLE, ExchangeType.FANOUT)
    await _declare_exchange(channel, RETURN_EXCHANGE, ExchangeType.DIRECT, alternate=UNROUTABLE)
    for name, args in ladder_declarations(specs, version):
        await _declare_queue(channel, name, args, version)
        shared.append(name)
    await _bind(channel, parking_queue_name(), UNROUTABLE, "")
    midnight = [MIDNIGHT_QUEUE] if any(s.parks_until_midnight for s in specs) else []
    for name in [*(ladder_queue_name(d) for d in ladder_delays_ms(specs)), *midnight]:
        await _declare_exchange(channel, name, ExchangeType.FANOUT)
        # A fanout ignores the binding's key: "" says so.
        await _bind(channel, name, name, "")
    for spec in specs:
        for name, args in _own_declarations(spec, version):
            await _declare_queue(channel, name, args, version)
            declared.append(name)
        for lane in spec.lane_queues(version):
            await _bind(channel, lane, RETURN_EXCHANGE, lane)
    # Results queues last: one that is also a handler queue here was declared above with that
    # handler's own options, which win over the defaults.
    for spec in specs:
        for name, args in results_queue_declarations(spec, version):
            if name not in declared:
                await _declare_or_keep(channel, name, args)
                declared.append(name)
    return DeclaredQueues(declared, shared)


async def _declare_queue(
    channel: AbstractChannel, name: str, args: dict[str, object], version: ServerVersion | None
) -> None:
    """Declare one queue of ours; a DLQ of an older broker is kept, any other conflict is a
    ``TopologyConflictError``."""
    try:
        await channel.declare_queue(name, durable=True, arguments=args)  # type: ignore[arg-type]
    except aiormq.exceptions.ChannelAccessRefused:
        await _check_exists(channel, name)
    except aiormq.exceptions.ChannelPreconditionFailed as e:
        text = str(e)
        match = _INEQUIVALENT_ARG.search(text)
        argument = match.group(1) if match else None
        if name.endswith(DLQ_SUFFIX) and argument in dlq_plan(version).extra_arguments:
            await _declare_older_dlq(channel, name, version)
        else:
            raise TopologyConflictError(name, argument, text) from e


async def _declare_exchange(
    channel: AbstractChannel, name: str, kind: ExchangeType, *, alternate: str | None = None
) -> None:
    """Declare a durable exchange of ours. Without configure permission (a least-privilege
    worker) it must exist already: an operator's ``weclaw-mq declare`` made it."""
    arguments: dict[str, Any] = {} if alternate is None else {"alternate-exchange": alternate}
    try:
        await channel.declare_exchange(name, kind, durable=True, arguments=arguments)
    except aiormq.exceptions.ChannelAccessRefused:
        await channel.reopen()
        try:
            await channel.declare_exchange(name, kind, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as e:
            await channel.reopen()
            raise ConfigurationError(
                f"exchange {name!r} does not exist and this user may not declare it (no "
                "configure permission): run 'weclaw-mq declare MODULE:APP' as an operator first"
            ) from e


async def _bind(channel: AbstractChannel, queue: str, exchange: str, key: str) -> None:
    """Bind ``queue`` to ``exchange`` by ``key`` (again: a no-op). A least-privilege worker
    may not bind: an operator's ``weclaw-mq declare`` did."""
    try:
        await (await channel.get_underlay_channel()).queue_bind(queue, exchange, routing_key=key)
    except aiormq.exceptions.ChannelAccessRefused:
        await channel.reopen()
        log.debug("binding %s to %s left to an operator (no permission)", queue, exchange)


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

"""The queues of one handler and their arguments, declared idempotently.

For a handler queue ``Q`` (names from ``naming``):

| queue           | type   | arguments                                                      |
|-----------------|--------|----------------------------------------------------------------|
| Q               | quorum | dead-letter to Q.dlq (at-least-once, reject-publish), delivery |
|                 |        | limit, optional max length                                     |
| Q.retry.<delay> | quorum | x-message-ttl = delay, dead-letter back to Q (at-least-once);  |
|                 |        | one per policy delay and per step of ``delays.STEP_DELAYS_MS`` |
| Q.dlq           | quorum | nothing expires or overflows there; from RabbitMQ 4.0 on, the  |
|                 |        | default delivery limit turned off (x-delivery-limit -1)        |

Priorities (``priority.plan_priorities``): where the broker has none usable, the HIGH and
URGENT levels get lanes ``Q.lane.high`` / ``Q.lane.urgent``, each declared like Q (dead-letter
to the one Q.dlq) with delay queues of its own (``Q.lane.high.retry.<delay>``, dead-lettering
back to that lane): a retried task comes back to its lane, and the number of queues stays
fixed (levels x (1 + delays) + 1), whatever delays ``Retry(after_s=)`` and
``publish(delay_s=)`` ask for (``weclaw_mq.delays``). A ``queue_type="classic"`` handler
queue is classic with ``x-max-priority`` (classic queues refuse ``x-delivery-limit`` and the
at-least-once dead-letter strategy, so it has neither); its delay queues and DLQ stay quorum.

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
from aio_pika.abc import AbstractChannel

from .broker_version import ServerVersion, dlq_plan
from .errors import ConfigurationError, TopologyConflictError
from .naming import dlq_name, lane_queue_name, retry_queue_name
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


def _quorum_dead_lettering(target: str) -> dict[str, object]:
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": DEFAULT_EXCHANGE,
        "x-dead-letter-routing-key": target,
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


def retry_queue_arguments(
    spec: QueueSpec, delay_ms: int, lane: str | None = None
) -> dict[str, object]:
    # One queue per delay: RabbitMQ expires messages only at the head of a queue, so mixed
    # per-message delays in one queue would hold short delays behind long ones.
    args = _quorum_dead_lettering(lane or spec.name)
    args["x-message-ttl"] = delay_ms
    return args


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
    # Q first (the NORMAL lane), then the higher lanes: each with its own delay queues.
    for lane in reversed(spec.lane_queues(version)):
        decls.append((lane, work_queue_arguments(spec)))
        for delay_ms in spec.retry_delays_ms:
            decls.append(
                (retry_queue_name(lane, delay_ms), retry_queue_arguments(spec, delay_ms, lane))
            )
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
    # Results queues last: one that is also a handler queue here was declared above with that
    # handler's own options, which win over the defaults.
    for spec in specs:
        for name, args in results_queue_declarations(spec, version):
            if name not in declared:
                await _declare_or_keep(channel, name, args)
                declared.append(name)
    return declared


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

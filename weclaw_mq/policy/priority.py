"""Task priorities (NORMAL, HIGH, URGENT) and how each broker version carries them.

What the broker offers, for the queue type a handler declares (measured on 3.10.8 where
marked, else from RabbitMQ's release notes):

- quorum, 3.10 - 3.13: no priorities; ``x-max-priority`` is refused with PRECONDITION_FAILED
  (measured on 3.10.8).
- quorum, 4.0 - 4.2: two levels that are not strict: a message above 4 is "high", served
  about 2 high : 1 normal, and no priority counts as 4. Two non-strict levels cannot give
  URGENT > HIGH > NORMAL: an URGENT task may wait behind HIGH ones and a NORMAL one may be
  served ahead of an URGENT one (one in three deliveries), so we do not use them.
- quorum, 4.3 and newer: 32 strict levels, ``x-max-priority`` ignored: native.
- classic (any version): ``x-max-priority`` gives strict levels: native.

Where the broker gives no usable priority we use a *lane* per level: the NORMAL lane is the
handler queue ``Q`` itself (existing producers and queues keep working), the higher levels get
their own queues (``naming.lane_queue_name``), and the worker serves the highest lane that
has a task waiting (``worker.lanes``). ``plan_priorities`` is the one place that decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from weclaw_mq.contract.naming import lane_queue_name
from weclaw_mq.errors import InvalidPriorityError
from weclaw_mq.policy.broker_version import ServerVersion

# The version each rule starts at.
NATIVE_QUORUM_PRIORITY_FROM = (4, 3)

QUORUM = "quorum"
CLASSIC = "classic"
QUEUE_TYPES = (QUORUM, CLASSIC)


class Priority(enum.Enum):
    """A task's priority: NORMAL, HIGH or URGENT.

    ``Priority("high")`` and ``parse_priority("high")`` read the wire and user spelling.

    Attributes:
        NORMAL: The default; a task without a priority header is NORMAL.
        HIGH: Served before NORMAL.
        URGENT: Served before HIGH.
    """

    NORMAL = "normal"
    HIGH = "high"
    URGENT = "urgent"

    @property
    def rank(self) -> int:
        """0 for NORMAL, 1 for HIGH, 2 for URGENT: higher runs first."""
        return _RANKS[self]


_RANKS = {Priority.NORMAL: 0, Priority.HIGH: 1, Priority.URGENT: 2}
# Highest first: the order the worker looks at lanes in.
BY_URGENCY = (Priority.URGENT, Priority.HIGH, Priority.NORMAL)


def parse_priority(value: object) -> Priority:
    """A ``Priority``, or one of the strings ``"normal"``, ``"high"``, ``"urgent"`` (any case);
    anything else is an ``InvalidPriorityError``."""
    if isinstance(value, Priority):
        return value
    if isinstance(value, str):
        try:
            return Priority(value.strip().lower())
        except ValueError:
            pass
    raise InvalidPriorityError(
        f"priority must be Priority.NORMAL, HIGH or URGENT (or 'normal', 'high', 'urgent'), "
        f"got {value!r}"
    )


def priority_from_header(value: object) -> Priority:
    """The priority a delivery carries; a missing or foreign value is NORMAL (a message from
    a producer that predates priorities)."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    try:
        return parse_priority(value)
    except InvalidPriorityError:
        return Priority.NORMAL


def check_queue_type(queue_type: str) -> str:
    if queue_type not in QUEUE_TYPES:
        raise InvalidPriorityError(
            f"queue_type must be one of {', '.join(QUEUE_TYPES)}, got {queue_type!r}"
        )
    return queue_type


@dataclass(frozen=True)
class PriorityPlan:
    """How priorities are carried for one queue type on one broker version."""

    # "lanes": a queue per level, served highest first by the worker; "native": one queue,
    # the broker orders by the AMQP ``priority`` property.
    mode: str
    # The AMQP priority property per level on native plans (empty on lanes).
    amqp_priority: dict[Priority, int]
    # Arguments the handler queue Q needs on this plan (``x-max-priority`` on classic).
    queue_arguments: dict[str, object]
    why: str

    @property
    def lanes(self) -> tuple[Priority, ...]:
        """The levels with a queue of their own, highest first (only NORMAL when native)."""
        return BY_URGENCY if self.mode == "lanes" else (Priority.NORMAL,)


# Classic: 0 is what a message without the property gets, so old producers stay NORMAL.
_CLASSIC_LEVELS = {Priority.NORMAL: 0, Priority.HIGH: 1, Priority.URGENT: 2}
CLASSIC_MAX_PRIORITY = 2
# Quorum from 4.0: a message without the property counts as 4, so NORMAL is 4 (old producers
# stay NORMAL) and the higher levels sit above it.
_QUORUM_LEVELS = {Priority.NORMAL: 4, Priority.HIGH: 5, Priority.URGENT: 6}


def plan_priorities(
    version: ServerVersion | None, queue_type: str = QUORUM, *, fair: bool = False
) -> PriorityPlan:
    """The plan for a handler queue of ``queue_type`` on ``version``; an unknown version gets
    lanes, which work on every version. A handler with fair share (``fair``) gets lanes on
    every version: its NORMAL level is several queues served in turn, so a native level in
    one of them could not run ahead of the others' NORMAL tasks."""
    check_queue_type(queue_type)
    if fair:
        why = "fair share: the NORMAL level is several queues, so a lane per level above it"
        return PriorityPlan(mode="lanes", amqp_priority={}, queue_arguments={}, why=why)
    if queue_type == CLASSIC:
        return PriorityPlan(
            mode="native",
            amqp_priority=dict(_CLASSIC_LEVELS),
            queue_arguments={"x-max-priority": CLASSIC_MAX_PRIORITY},
            why="classic queue: x-max-priority gives strict levels on every version",
        )
    if version is not None and version.at_least(NATIVE_QUORUM_PRIORITY_FROM):
        return PriorityPlan(
            mode="native",
            amqp_priority=dict(_QUORUM_LEVELS),
            queue_arguments={},
            why=f"quorum queue on {version}: strict native priorities",
        )
    if version is not None and version.at_least((4, 0)):
        why = (
            f"quorum queue on {version}: its two non-strict levels (about 2 high : 1 normal) "
            "cannot put URGENT ahead of HIGH ahead of NORMAL, so a lane per level"
        )
    else:
        why = f"quorum queue on {version or 'an unknown version'}: no priorities, a lane per level"
    return PriorityPlan(mode="lanes", amqp_priority={}, queue_arguments={}, why=why)


def route(
    queue: str,
    level: Priority,
    version: ServerVersion | None,
    queue_type: str = QUORUM,
    *,
    fair: bool = False,
) -> tuple[str, int | None]:
    """Where a task of ``level`` for handler queue ``queue`` is published, and the AMQP
    priority property it carries (None: none). NORMAL is Q without the property on every
    plan (what a producer that predates priorities sends; a fair handler's producer picks
    the tenant's lane of that level itself); used by publish and DLQ re-drives.
    """
    if level is Priority.NORMAL:
        return queue, None
    plan = plan_priorities(version, queue_type, fair=fair)
    if plan.mode == "lanes":
        return lane_queue_name(queue, level.value), None
    return queue, plan.amqp_priority[level]

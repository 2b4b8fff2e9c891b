"""What differs between the RabbitMQ versions we support (3.10 and newer), as pure functions of
the version the broker announces in its ``connection.start`` server properties.

The facts behind each rule (quorum queues, the only type our topology declares):

- 3.10 - 3.13: no delivery limit unless one is set. ``x-delivery-limit`` counts returns
  (nack/reject with requeue, a channel or connection closed with the message unacked), and a
  message returned more times than the limit is dead-lettered, or dropped when its queue has
  no dead-letter target. A limit of -1 is accepted by a declare on 3.10 but is NOT "off":
  every return exceeds it.
- 4.0 and newer: every quorum queue gets a delivery limit of 20 unless told otherwise; -1
  turns it off. A DLQ has nowhere to dead-letter to, so its 20th return drops the message.
- 4.3 and newer: only real failures (reject, a crashed consumer) count toward it; rotation
  (below) does not depend on that.
- 3.13 and newer: ``x-`` headers belong to the broker; a client-sent ``x-death`` is never
  interpreted (kept or not, it is not the broker's record).

Adding ``x-delivery-limit`` to a DLQ that already exists without it is a PRECONDITION_FAILED
(RabbitMQ never changes a queue's arguments), so a DLQ declared before 4.0 keeps the default
limit until an operator sets a policy; see ``DlqPlan.policy_hint``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The version each rule starts at.
DEFAULT_DELIVERY_LIMIT_FROM = (4, 0)
QUORUM_DEFAULT_DELIVERY_LIMIT = 20

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class ServerVersion:
    major: int
    minor: int
    patch: int = 0

    def at_least(self, major_minor: tuple[int, int]) -> bool:
        return (self.major, self.minor) >= major_minor

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def parse_server_version(value: object) -> ServerVersion | None:
    """``"3.10.8"``, ``b"4.0.5"`` or ``"4.2.0-rc.1"`` -> a version; None when unreadable."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if not isinstance(value, str):
        return None
    match = _VERSION.match(value)
    if match is None:
        return None
    return ServerVersion(int(match[1]), int(match[2]), int(match[3] or 0))


@dataclass(frozen=True)
class DlqPlan:
    """How a DLQ is declared and looked at on one broker version."""

    # Arguments for a new Q.dlq beyond its type: the delivery limit turned off where the
    # broker would otherwise impose one, nothing where it would not (or where -1 is unsafe).
    extra_arguments: dict[str, object]
    # The limit a Q.dlq declared without x-delivery-limit lives under (None: none).
    default_delivery_limit: int | None
    # How a look reads the DLQ: always "rotate" (take each message, publish an exact copy
    # to the tail with a confirm, then ack the original): no message is ever handed back, so
    # nothing counts toward any limit and x-delivery-count never changes, on every version.
    inspection: str = "rotate"

    def policy_hint(self, dlq: str) -> str | None:
        """The command that turns the limit off for a DLQ declared before the default
        existed, or None when this version needs none."""
        if self.default_delivery_limit is None:
            return None
        pattern = "^" + re.escape(dlq) + "$"
        return (
            f"rabbitmqctl set_policy --apply-to queues weclaw-dlq-no-limit '{pattern}' "
            "'{\"delivery-limit\": -1}'"
        )


def dlq_plan(version: ServerVersion | None) -> DlqPlan:
    """The plan for ``version``; an unknown version gets the 3.x plan, which never sets -1
    (on 3.x that would dead-letter or drop a message at its first return)."""
    if version is None or not version.at_least(DEFAULT_DELIVERY_LIMIT_FROM):
        return DlqPlan(extra_arguments={}, default_delivery_limit=None)
    return DlqPlan(
        extra_arguments={"x-delivery-limit": -1},
        default_delivery_limit=QUORUM_DEFAULT_DELIVERY_LIMIT,
    )

"""The control-flow exceptions a handler raises to steer its task: ``Reject`` and ``Retry``.

They are decisions, not faults, so they stand apart from ``WeclawMQError``.
"""

from __future__ import annotations

from typing import ClassVar


class Reject(Exception):
    """Send this task to the dead-letter queue now: retrying cannot fix it."""

    error_type: ClassVar[str] = "weclaw_mq.Reject"  # stable, as in ``errors``

    def __init__(self, reason: str = "rejected by handler") -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """Retry this task after the policy's next delay (e.g. the model's API said "busy").

    It counts as an attempt, like a failure, so a task cannot ask for retries forever; it is
    logged at INFO rather than as an error. The delay comes from the policy only: each delay
    has its own delay queue, declared up front, so a handler cannot pick an arbitrary one.
    """

    error_type: ClassVar[str] = "weclaw_mq.Retry"  # stable, as in ``errors``

    def __init__(self, reason: str = "retry requested by handler") -> None:
        super().__init__(reason)
        self.reason = reason

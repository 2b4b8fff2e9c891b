"""The control-flow exceptions a handler raises to steer its task: ``Reject`` and ``Retry``.

They are decisions, not faults, so they stand apart from ``WeclawMQError``.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import ClassVar

from weclaw_mq.policy.delays import check_delay

log = logging.getLogger("weclaw_mq.control_flow")


class Reject(Exception):
    """Send this task to the dead-letter queue now: retrying cannot fix it."""

    # The class docstring stays one paragraph: docs/reference/errors.md shows it whole. The
    # API page merges this __init__'s sections into the class.
    error_type: ClassVar[str] = "weclaw_mq.Reject"  # stable, as in ``errors``

    def __init__(self, reason: str = "rejected by handler") -> None:
        """The handler's decision, with its reason.

        Args:
            reason: Why: the exception's message, in the task's error (``Reject: reason``).
        """
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """Retry this task after the policy's next delay, or after ``after_s`` seconds.

    For example when the model's API said "busy, come back in 20 s" (see ``retry_after_s``).
    It counts as one attempt, like a failure, so a task cannot ask for retries forever; it is
    logged at INFO rather than as an error. An ``after_s`` delay is served by the lane's
    bounded set of delay queues (``weclaw_mq.policy.delays``): never earlier, at most ~1 s later.
    """

    # As for Reject: the class docstring is the errors page's line, the sections are here.
    error_type: ClassVar[str] = "weclaw_mq.Retry"  # stable, as in ``errors``

    def __init__(
        self, reason: str = "retry requested by handler", *, after_s: float | None = None
    ) -> None:
        """The handler's decision, with its reason and, if it has one, its delay.

        Args:
            reason: Why: the exception's message, in the task's error (``Retry: reason``).
            after_s: Seconds to wait instead of the policy's delay; None for the policy's.

        Raises:
            ConfigurationError: An ``after_s`` that is not a number of seconds >= 0.
        """
        super().__init__(reason)
        self.reason = reason
        # Checked here, in the handler's frame: a bad value fails loudly where it was written.
        self.after_ms = None if after_s is None else check_delay(after_s, "Retry(after_s=)")


def retry_after_s(
    value: str | None, *, default: float | None = None, now: datetime | None = None
) -> float | None:
    """Seconds to wait from an HTTP ``Retry-After`` header value.

    ``raise Retry("rate limited", after_s=retry_after_s(response.headers.get("Retry-After")))``

    Args:
        value: The header's value (RFC 9110: a number of seconds, or an HTTP date), or None
            when the response has none.
        default: What to answer when the header is absent or unreadable (an unreadable one
            is logged at WARNING): ``Retry(after_s=None)`` then falls back to the retry
            policy's own delay.
        now: The time an HTTP date is counted from; default now (UTC).

    Returns:
        The seconds to wait (a date in the past is 0), or ``default``.
    """
    if value is None:
        return default
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            log.warning("unreadable Retry-After %r; using the fallback %r", value[:100], default)
            return default
        if when.tzinfo is None:  # an HTTP date is GMT; parsedate says "-0000" for none given
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    if not math.isfinite(seconds) or seconds < 0:
        log.warning("unreadable Retry-After %r; using the fallback %r", value[:100], default)
        return default
    return seconds

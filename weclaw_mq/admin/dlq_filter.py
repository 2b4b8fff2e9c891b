"""Which dead letters a DLQ command acts on: one predicate, used by list, show's neighbours,
export, requeue and purge alike. Pure: no broker I/O.

A dead letter matches when it passes every filter given (AND across filters); a filter given
several values (``--task-id A --task-id B``) matches any of them (OR within a filter). No
filter at all matches everything.

- task ids: the message's ``message_id``;
- error types: compared through ``stable_error_type``, so ``--error-type RuntimeError`` and
  ``--error-type builtins.RuntimeError`` match dead letters written before and after stable
  names alike; a dead letter without an error type (dead-lettered by the broker) never
  matches an error-type filter;
- reasons: the dead-letter reason exactly as ``dlq list`` prints it (``rejected``,
  ``retries_exhausted``, ``delivery_limit``, ``expired``, ``invalid_payload``, ...);
- since / until: its failure time, the time it was dead-lettered (``last_failure_at``):
  ``since <= t < until``. A dead letter without a failure time never matches a time filter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from weclaw_mq.admin.dlq_message import DeadLetter
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.failures import stable_error_type

# "90s", "15m", "2h", "3d", "1w": a time that long before now.
_RELATIVE = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_time(text: str, *, now: datetime) -> datetime:
    """A ``--since``/``--until`` value: ISO-8601 (``2026-11-30T12:00``, ``2026-11-30``; a time
    without an offset is UTC) or a duration before ``now`` (``90s``, ``15m``, ``2h``, ``3d``,
    ``1w``). ``ConfigurationError`` for anything else."""
    relative = _RELATIVE.match(text)
    if relative:
        seconds = float(relative["n"]) * _UNIT_S[relative["unit"]]
        try:
            return now - timedelta(seconds=seconds)
        except OverflowError:  # before year 1, or more days than timedelta holds
            raise ConfigurationError(
                f"{text!r} reaches before the year 1: give a shorter duration or an ISO-8601 time"
            ) from None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigurationError(
            f"{text!r} is not a time: give ISO-8601 (2026-11-30T12:00:00+00:00, 2026-11-30) "
            "or a duration before now (90s, 15m, 2h, 3d, 1w)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@dataclass(frozen=True)
class DlqFilter:
    """What ``--task-id``, ``--error-type``, ``--reason``, ``--since`` and ``--until`` select.
    An empty set or None means "not filtered on this"."""

    task_ids: frozenset[str] = frozenset()
    error_types: frozenset[str] = frozenset()
    reasons: frozenset[str] = frozenset()
    since: datetime | None = None
    until: datetime | None = None

    @classmethod
    def of(
        cls,
        *,
        task_ids: Iterable[str] | None = None,
        error_types: Iterable[str] | None = None,
        reasons: Iterable[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> DlqFilter:
        if since is not None and until is not None and since >= until:
            raise ConfigurationError(
                f"--since ({since.isoformat(timespec='seconds')}) must be before --until "
                f"({until.isoformat(timespec='seconds')})"
            )
        return cls(
            task_ids=frozenset(task_ids or ()),
            # Stored as stable names: the dead letter's side is read through the same rule.
            error_types=frozenset(stable_error_type(e) for e in error_types or ()),
            reasons=frozenset(reasons or ()),
            since=since,
            until=until,
        )

    @property
    def everything(self) -> bool:
        """No filter given: every dead letter matches."""
        return not (
            self.task_ids
            or self.error_types
            or self.reasons
            or self.since is not None
            or self.until is not None
        )

    def matches(self, dead: DeadLetter) -> bool:
        if self.task_ids and dead.task_id not in self.task_ids:
            return False
        if self.error_types and (
            dead.error_type is None or stable_error_type(dead.error_type) not in self.error_types
        ):
            return False
        if self.reasons and dead.reason not in self.reasons:
            return False
        if self.since is None and self.until is None:
            return True
        at = _aware(dead.last_failure_at)
        if at is None:
            return False
        if self.since is not None and at < self.since:
            return False
        return self.until is None or at < self.until

    def describe(self) -> str:
        """The filter in words, for summaries ("" when there is none)."""
        parts = []
        if self.task_ids:
            parts.append("task id " + "|".join(sorted(self.task_ids)))
        if self.error_types:
            parts.append("error type " + "|".join(sorted(self.error_types)))
        if self.reasons:
            parts.append("reason " + "|".join(sorted(self.reasons)))
        if self.since is not None:
            parts.append(f"failed at or after {self.since.isoformat(timespec='seconds')}")
        if self.until is not None:
            parts.append(f"failed before {self.until.isoformat(timespec='seconds')}")
        return ", ".join(parts)


EVERYTHING = DlqFilter()


def _aware(value: datetime | None) -> datetime | None:
    # Our failure headers and the broker's x-death times carry an offset; a foreign producer's
    # naive time is read as UTC, like a naive --since.
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)

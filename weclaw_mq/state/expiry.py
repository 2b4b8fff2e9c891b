"""How a task's deadline (``weclaw_mq.contract.lifetime``) shows in its record. Pure.

The broker expiring a task in ``Q`` writes no record, so the deadline kept in the queued (or
retrying) record is the witness: past it, ``App.status`` answers ``expired``. The same holds
for a task still in the local outbox (``stored_locally``): relayed late, the worker
dead-letters it as expired on delivery.
"""

from __future__ import annotations

from datetime import datetime

from weclaw_mq.policy.retry import DeadLetterReason
from weclaw_mq.state.protocol import TaskState, TaskStatus

# Records that only wait for a worker: past the deadline, no worker will run the task.
_WAITING = frozenset({TaskStatus.STORED_LOCALLY, TaskStatus.QUEUED, TaskStatus.RETRYING})


def as_seen_at(state: TaskState | None, at: datetime) -> TaskState | None:
    """The record as ``status()`` answers it: a stored_locally, queued or retrying record
    whose deadline has passed reads as ``expired``. The broker expired the task (or a worker
    will, on delivery) and nobody may ever write to the record again, so the deadline is the
    only witness."""
    if (
        state is None
        or state.status not in _WAITING
        or state.expires_at is None
        or at < state.expires_at
    ):
        return state
    return state.model_copy(
        update={"status": TaskStatus.EXPIRED, "reason": DeadLetterReason.EXPIRED.value}
    )


def until_deadline_s(state: TaskState | None, at: datetime) -> float | None:
    """Seconds from ``at`` until a waiting record's deadline; None when none is ahead (no
    deadline, already past, or a running task: its worker took it in time and writes its
    end)."""
    if state is None or state.status not in _WAITING or state.expires_at is None:
        return None
    until = (state.expires_at - at).total_seconds()
    return until if until > 0 else None


def record_ttl_s(state: TaskState, base_ttl_s: float, at: datetime) -> float:
    """How long the store keeps ``state``: a waiting record lives until ``base_ttl_s`` after
    its deadline, so ``status()`` can still answer ``expired`` (a 7-day lifetime outlives
    the default 24 h record TTL)."""
    if state.status not in _WAITING or state.expires_at is None:
        return base_ttl_s
    return max(base_ttl_s, (state.expires_at - at).total_seconds() + base_ttl_s)

"""Cancelling a task (``App.cancel``): what a cancel does to the task's state. Pure rules; the
stores apply them in one atomic step (``state.redis_cancel``, ``state.memory``).

A cancel meets the task in one of three places:

- waiting: queued, retrying in a delay queue, or not published (or recorded) yet. The cancel
  marker ``weclaw_mq:cancel:{T}`` (a set of queue names, ``*`` for every queue) makes the
  claim of its next delivery answer ``Claim.CANCELLED``: the worker acks it without running
  it. The marker lives as long as a record (``WECLAW_MQ_RESULT_TTL_S``): a task first
  delivered later than that runs after all.
- running: the request goes out on the one channel ``weclaw_mq:cancels``; the worker running
  the task cancels its handler (``worker.cancel_watch``), acks the message and never retries it.
- finished (succeeded, dead_lettered, expired or cancelled, as ``status()`` reads it):
  nothing changes, and the answer says so (``CancelOutcome.FINISHED``).

The record is written ``cancelled`` together with the marker, and only if the record read a
moment before is still the one stored (compare and set): a task that finished in between is
never overwritten by ``cancelled`` (the store reads again and answers ``FINISHED``), and
``cancelled`` is final for every later writer, like ``succeeded``.

Without a queue, a cancel applies to the task's latest record and marks every queue (``*``):
the stages of a pipeline that share a task id never run after it. A cancel of a task of which
no record exists yet (``PENDING``) writes a ``cancelled`` record only when it names the
queue; without one there is nowhere to write it, and ``status()`` reads ``queued`` once the
task is published, until a worker acks it unrun and records ``cancelled``.

A cancel that names a queue where the task has no record while it has one in another queue
(a typo, or a later stage of a pipeline) writes no record at all: a ``cancelled`` record there
would become the task's latest and ``status()`` would answer ``cancelled`` for a task that
runs on. It only leaves the marker for that queue, and its answer (``PENDING``) names the
other record (``Cancellation.elsewhere``). ``App.cancel(..., pending=False)`` (the CLI's
default) changes nothing for a task with no record where it looks: ``UNKNOWN``.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import datetime

from weclaw_mq.state.expiry import as_seen_at
from weclaw_mq.state.protocol import Cancellation, CancelOutcome, TaskState, TaskStatus

# The marker's member for "every queue of this task id".
ALL_QUEUES = "*"
# How many times a cancel re-reads a record that changed under it before giving up: each
# retry means a worker wrote the record in the last round trip, which it does a few times
# per attempt at most.
CANCEL_ATTEMPTS = 10


def scope_of(queue: str | None) -> str:
    """The marker member a cancel adds: its queue, or every queue."""
    return ALL_QUEUES if queue is None else queue


def covers(scopes: Collection[str], queue: str) -> bool:
    """Do the marker's members cancel deliveries from ``queue``?"""
    return ALL_QUEUES in scopes or queue in scopes


def finished(state: TaskState | None, at: datetime) -> TaskState | None:
    """The record as ``status()`` reads it at ``at`` when it is final, else None: past its
    deadline, a waiting task has expired, and a cancel must not turn that into cancelled."""
    seen = as_seen_at(state, at)
    return seen if seen is not None and seen.status.terminal else None


def other_record(
    state: TaskState | None, latest: TaskState | None, queue: str | None
) -> TaskState | None:
    """The task's latest record when a cancel names ``queue`` and finds no record there."""
    if queue is None or state is not None or latest is None or latest.queue == queue:
        return None
    return latest


def cancelled_record(
    state: TaskState | None,
    task_id: str,
    queue: str | None,
    at: datetime,
    *,
    other: TaskState | None = None,
) -> TaskState | None:
    """The record a cancel writes over ``state`` (None: none to write: no queue known, or the
    task's latest record, ``other``, is in another queue and must stay its latest)."""
    if state is not None:
        return state.model_copy(
            update={"status": TaskStatus.CANCELLED, "result": None, "updated_at": at}
        )
    if queue is None or other is not None:
        return None
    return TaskState(task_id=task_id, queue=queue, status=TaskStatus.CANCELLED, updated_at=at)


def answer(task_id: str, written: TaskState | None, other: TaskState | None = None) -> Cancellation:
    """The answer once the cancel is stored."""
    if written is None:
        return Cancellation(task_id, CancelOutcome.PENDING, None, other)
    return Cancellation(task_id, CancelOutcome.CANCELLED, written)


def request_message(task_id: str, queue: str | None) -> str:
    """What a cancel publishes on ``CANCEL_CHANNEL`` for the workers."""
    return json.dumps({"task_id": task_id, "queue": queue})


def read_request(data: bytes | str) -> tuple[str, str | None] | None:
    """(task id, queue or None) from a request message; None when it is not one of ours."""
    try:
        fields = json.loads(data)
        task_id, queue = fields["task_id"], fields["queue"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(task_id, str) or not (queue is None or isinstance(queue, str)):
        return None
    return task_id, queue

"""Which status may follow which in a task's record: the one table every record write is
checked against, in the same step as the write (a compare and set). Pure.

Both stores enforce it: ``state.memory`` calls ``may_follow``; ``state.redis`` builds its Lua
table from ``TRANSITIONS`` at import, so the two can never disagree.

The rules, and why:

- A task with no record yet (``None``) may take any status: the first writer may be a
  publish (``queued``), the outbox (``stored_locally``), a worker that got a copy from a
  foreign producer (``running``), or one that ends it (any final).
- ``stored_locally`` -> ``queued`` (the relay sent it) or anything a worker writes (the
  broker held a copy after an unknown outcome). ``queued`` -> ``stored_locally`` (the publish
  beside which ``queued`` was written timed out: the outbox holds it now).
- Once a worker wrote ``running`` or ``retrying`` the task is on the broker: it never reads
  ``stored_locally`` again. It may read ``queued`` again (a limit deferred it; ``dlq
  requeue`` of a task the broker dead-lettered after crash loops), which is why the relay's
  own ``queued`` is narrowed further by the caller (``only_over``: only over
  ``stored_locally``), never a general ``queued`` write.
- ``succeeded`` and ``cancelled`` are final for every writer.
- ``dead_lettered`` and ``expired`` are final but for the two ways a task leaves the DLQ:
  ``queued`` (``dlq requeue``) and ``running`` (a copy of it is run: its end is the truth,
  and a result it stores must not be refused). No late writer of ``queued`` reaches them:
  the publish writes only where no record exists and the relay only over
  ``stored_locally``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from weclaw_mq.state.protocol import TaskStatus

_S = TaskStatus
_EVERY = frozenset(TaskStatus)
_ON_THE_BROKER = _EVERY - {_S.STORED_LOCALLY}
_LEAVING_THE_DLQ = frozenset({_S.QUEUED, _S.RUNNING})

# current status (None: no record) -> the statuses that may be written over it.
TRANSITIONS: Mapping[TaskStatus | None, frozenset[TaskStatus]] = {
    None: _EVERY,
    _S.STORED_LOCALLY: _EVERY,
    _S.QUEUED: _EVERY,
    _S.RUNNING: _ON_THE_BROKER,
    _S.RETRYING: _ON_THE_BROKER,
    _S.SUCCEEDED: frozenset(),
    _S.CANCELLED: frozenset(),
    _S.DEAD_LETTERED: _LEAVING_THE_DLQ,
    _S.EXPIRED: _LEAVING_THE_DLQ,
}

# ``only_over`` of a write that may only create a record (``only_if_new``).
ONLY_NEW: frozenset[TaskStatus] = frozenset()


def may_follow(
    current: TaskStatus | None,
    new: TaskStatus,
    *,
    only_over: Collection[TaskStatus] | None = None,
) -> bool:
    """May ``new`` be written over a record that reads ``current``? ``only_over`` narrows the
    table for one writer: then only over no record or one of those statuses."""
    if new not in TRANSITIONS.get(current, ONLY_NEW):
        return False
    return only_over is None or current is None or current in only_over


def narrowing(
    only_if_new: bool, only_over: Collection[TaskStatus] | None
) -> Collection[TaskStatus] | None:
    """The ``only_over`` of a write given as ``record``'s two options."""
    return ONLY_NEW if only_if_new else only_over

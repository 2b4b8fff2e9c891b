"""A task's state, and the one protocol the worker and ``App`` use to keep it.

A task has one record per queue it went through, overwritten as it moves (stored_locally ->)
queued -> running -> (retrying ->)* succeeded | dead_lettered | expired | cancelled. Every write
is a compare and set over one table of which status may follow which
(``state.transitions``): a final record is never turned back by a late or duplicate writer,
but for a task leaving the DLQ (``state.cancel_records`` says how a cancel meets a running task).
Two pipeline stages that share a task id (``ctx.publish(..., task_id=ctx.task_id)``)
therefore keep two records, and neither can hide the other. Reading without a queue answers
the task's most recently written record (its "latest" pointer).

Beside the records, the store keeps the idempotency guard's claim per (queue, task id):
- held by one attempt (its ``owner`` token) under a lease, kept alive by ``holding`` while the
  handler runs and its result is stored; the claim also names its worker (the store), and
  holds only while that worker lives: if the worker dies, a redelivered copy claims it as soon
  as the worker's heartbeat lapses (seconds), else when the lease does;
- ``done`` for ``done_ttl_s`` once the result is stored: copies are acked unrun. The first
  finish wins: a finish that finds the task done writes nothing (``Finish.DONE``).

``TaskStore`` is everything the worker and ``App`` ask of a store; nothing calls past it.
``state.redis.RedisTaskStore`` is the default, ``state.memory.MemoryTaskStore`` keeps the same
rules in one process (for tests). A store that fails or does not answer raises
``StateUnavailableError``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from weclaw_mq.state.watches import WatchStep

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


class TaskStatus(StrEnum):
    """Where a task is in its life, as its record says (``state.transitions``).

    Attributes:
        STORED_LOCALLY: In the local outbox, not yet on the broker.
        QUEUED: Published and confirmed; no worker has started it.
        RUNNING: A worker runs its handler.
        RETRYING: An attempt failed; it waits in a delay queue for the next.
        SUCCEEDED: The handler returned and its result is stored (final).
        DEAD_LETTERED: In ``Q.dlq``; the record's ``reason`` says why (final).
        EXPIRED: Outlived its lifetime before a worker ran it (final).
        CANCELLED: Cancelled by ``App.cancel`` before it finished (final).
    """

    # In the local outbox (``WECLAW_MQ_OUTBOX_PATH``), not yet on the broker: the relay
    # sends it once the broker answers (weclaw_mq.outbox).
    STORED_LOCALLY = "stored_locally"
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD_LETTERED = "dead_lettered"
    # Outlived its lifetime (TTL) before a worker ran it; in Q.dlq with reason "expired" (or
    # still in the local outbox: dead-lettered so once relayed).
    EXPIRED = "expired"
    # Cancelled by ``App.cancel`` before it finished: acked without running (again), or its
    # handler was cancelled mid-run (weclaw_mq.state.cancel_records).
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """Whether the status is final: succeeded, dead_lettered, expired or cancelled."""
        return self in (
            TaskStatus.SUCCEEDED,
            TaskStatus.DEAD_LETTERED,
            TaskStatus.EXPIRED,
            TaskStatus.CANCELLED,
        )


class Deferral(BaseModel):
    """Why a task waits without spending an attempt: the last deferral a worker recorded.

    Attributes:
        by: What deferred it: ``limit``, ``cap``, ``fallback``, ``breaker`` or ``threads``
            (no plain-def thread free).
        why: What it said, with the key where there is one (the limit's kind, the capped
            tenant, the queue whose models are down).
        next_try_at: When it comes back to a worker (it may be deferred again then).
        count: How many times the task was deferred so far.
    """

    by: str
    why: str
    next_try_at: datetime | None = None
    count: int = 1


class TaskState(BaseModel):
    """A task's record in one queue, as ``App.status`` and ``App.result`` answer it.

    Attributes:
        task_id: The task's id.
        queue: The handler queue the record is for.
        status: Where the task is.
        attempt: The attempt that wrote the record (0 before the first run).
        result: The handler's return value (succeeded).
        error: ``ErrorName: message`` of the last failure.
        reason: The dead-letter reason (dead_lettered, expired).
        expires_at: The task's deadline (see ``weclaw_mq.contract.lifetime``), or None: it
            lives until a worker runs it.
        updated_at: When the record was written.
        session_id: The session the task was published for (``App.publish(session_id=)``),
            if any.
        model: The model the attempt that wrote the record called (``ctx.model``: a fallback
            chain's choice, or a capped tenant's cheaper model), None for a handler without.
        deferred: On a ``queued`` record a worker wrote as it parked the task without an
            attempt (a limit, a cap, a fallback chain, a breaker, no free thread): why, and
            when it comes back; None otherwise.
        worker_gone: Set by the reader, never stored: the record reads ``running`` but no
            live worker runs the task (its worker died; the copy on the broker runs again
            once the broker or the guard's lease gives it back). ``updated_at`` is when it was
            last known to run.
        heartbeat_at: Set by the reader, never stored: on a ``running`` record, when the
            live worker that lists the task in the worker registry last beat (every
            ``worker_beat_s``): a run of hours shows it is alive; None when no live worker
            lists it, or the registry cannot tell.
    """

    task_id: str
    queue: str
    status: TaskStatus
    attempt: int = 0
    result: Any = None
    error: str | None = None
    reason: str | None = None
    # The task's deadline (see weclaw_mq.contract.lifetime), or None: it lives until a worker runs
    # it.
    expires_at: datetime | None = None
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    # The task's session (the x-weclaw-session-id header): App.tasks filters by it.
    session_id: str | None = None
    # The model of the attempt that wrote it (weclaw_mq.policy.fallback, policy.costs' cap).
    model: str | None = None
    # The last deferral (a worker parked it without an attempt): why, and its next try.
    deferred: Deferral | None = None
    # A reader's finding (App.status), never written by a worker: running, on no live worker.
    worker_gone: bool = False
    # A reader's finding (App.status), never written: when the worker running it last beat.
    heartbeat_at: datetime | None = None


class Claim(StrEnum):
    """The answer to ``TaskStore.claim``."""

    ACQUIRED = "acquired"  # this owner holds the task now: run it
    DONE = "done"  # finished before: ack without running
    BUSY = "busy"  # another attempt holds it now: come back later
    CANCELLED = "cancelled"  # cancelled (App.cancel): ack without running
    STALE = "stale"  # a long run's watch copy no longer needed (state.watches): ack it unrun


class Finish(StrEnum):
    """The answer to ``TaskStore.finish``."""

    FINISHED = "finished"  # marked done and the result written, by the claim's holder
    # Marked done and written, but another attempt held the claim (this one had lost it): the
    # other attempt's finish will find the task done.
    TAKEN = "taken"
    DONE = "done"  # another attempt finished first: nothing written, its result stands


def new_owner() -> str:
    """A token unique to one attempt: only its holder may renew or release a claim."""
    return uuid.uuid4().hex


class TaskStore(Protocol):
    """A task's records (one per (queue, task id)) and its idempotency claim."""

    # -- the guard ----------------------------------------------------------------------
    async def claim(
        self,
        queue: str,
        task_id: str,
        owner: str,
        *,
        running: TaskState | None = None,
        watch: int | None = None,
    ) -> Claim:
        """Claim (queue, task id) for ``owner`` under a lease, never check-then-set.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            owner: The attempt's token (``new_owner``).
            running: A record to write in the same step when the claim is granted.
            watch: The generation a long run's watch copy carries (``state.watches``): a
                stale one claims nothing.

        Returns:
            ``Claim.ACQUIRED`` (run it), ``Claim.DONE`` (finished before), ``Claim.BUSY``
            (another attempt holds it), ``Claim.CANCELLED`` (nothing claimed) when the task
            was cancelled in that queue, or ``Claim.STALE`` for a stale watch copy.
        """
        ...

    async def watch(self, queue: str, task_id: str, generation: int, step: WatchStep) -> int:
        """Move a long run's watch generation (``state.watches``).

        Args:
            queue: The handler queue.
            task_id: The task's id.
            generation: The copy's generation (``START``, ``RAISE``) or the run's (``END``).
            step: How it moves.

        Returns:
            The value written: the generation that counts now, or minus it once ended.
        """
        ...

    def holding(self, queue: str, task_id: str, owner: str) -> AbstractContextManager[None]:
        """Keep ``owner``'s lease alive while the body runs.

        The body is the handler, then its ending: a ``finish`` or ``release`` inside the body
        ends it.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            owner: The claim's holder.

        Returns:
            A context manager around the body.
        """
        ...

    async def release(self, queue: str, task_id: str, owner: str) -> None:
        """Drop the claim if ``owner`` still holds it, so the next copy runs at once.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            owner: The claim's holder.
        """
        ...

    async def finish(
        self, queue: str, task_id: str, result: TaskState | None, *, owner: str | None = None
    ) -> Finish:
        """Mark (queue, task id) done and write its final record, together.

        A crash can never keep one without the other.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            result: The final record to write, if any.
            owner: The claim's holder, checked; None marks done whoever holds it (for a copy
                that found the task's result stored).

        Returns:
            ``Finish.FINISHED``; ``Finish.TAKEN`` when another attempt held the claim (done
            and written all the same); ``Finish.DONE`` when the task was done already:
            nothing is written.
        """
        ...

    # -- the records --------------------------------------------------------------------
    async def record(
        self,
        state: TaskState,
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> bool:
        """Write ``state`` as the record of (state.queue, state.task_id), if its status may follow.

        Whether it may follow the stored one (``state.transitions``) is checked in the same
        step as the write.

        Args:
            state: The record to write.
            only_if_new: Only where no record exists.
            only_over: Only where none exists or it reads one of those statuses.

        Returns:
            True when written, False when refused.
        """
        ...

    async def record_many(
        self,
        states: Sequence[TaskState],
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> None:
        """``record`` for a batch, in as few round trips as the store allows.

        Args:
            states: The records to write.
            only_if_new: As in ``record``, for each.
            only_over: As in ``record``, for each.
        """
        ...

    async def forget_queued(self, queue: str, task_id: str) -> None:
        """Drop a ``queued`` record whose publish the broker refused: that task never existed.

        A record with another status is left alone.

        Args:
            queue: The handler queue.
            task_id: The task's id.
        """
        ...

    async def get(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        """The record of ``task_id`` in ``queue``.

        Args:
            task_id: The task's id.
            queue: The queue; without it, the task's latest record.

        Returns:
            The record, or None when none is kept.
        """
        ...

    async def wait(self, task_id: str, timeout_s: float, *, queue: str | None = None) -> TaskState:
        """That record once terminal, woken when it is written (not by polling).

        Args:
            task_id: The task's id.
            timeout_s: How long to wait, in seconds.
            queue: As in ``get``.

        Returns:
            The terminal record.

        Raises:
            ResultTimeoutError: None within ``timeout_s``.
        """
        ...

    # -- cancellation (weclaw_mq.state.cancel_records) ------------------------------------------
    async def cancel(self, task_id: str, *, queue: str | None = None) -> Cancellation:
        """Cancel the task unless its record is final, in one atomic step.

        The step writes the record ``cancelled``, leaves the cancel marker that makes every
        later claim answer ``Claim.CANCELLED``, and tells running workers.

        Args:
            task_id: The task's id.
            queue: The queue whose record is cancelled; without it, the latest record, and
                the marker covers every queue.

        Returns:
            What happened (``state.cancel_records``).
        """
        ...

    async def is_cancelled(self, queue: str, task_id: str) -> bool:
        """Does the cancel marker cover (queue, task id)? For deliveries that do not claim.

        Args:
            queue: The handler queue.
            task_id: The task's id.

        Returns:
            True when a cancel covers it.
        """
        ...

    async def watch_cancels(
        self,
        on_cancel: Callable[[str, str | None], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        """Until cancelled, pass on each cancel request to ``on_cancel``.

        Store failures are retried here.

        Args:
            on_cancel: Called as ``on_cancel(task_id, queue or None for all)`` for each
                cancel request.
            on_subscribed: Awaited after each (re)subscription: a request sent while
                unsubscribed is then found with ``is_cancelled``.
        """
        ...

    async def close(self) -> None:
        """Stop renewing leases and release what the store opened."""
        ...


class CancelOutcome(StrEnum):
    """What a cancel did (``Cancellation.outcome``).

    Attributes:
        CANCELLED: Its record now reads cancelled; it will not run to completion.
        PENDING: No record of it yet: the marker stops it when it is delivered.
        FINISHED: It had already ended: nothing was changed.
        UNKNOWN: No record where it looked, and no pending cancel asked: unchanged.
    """

    CANCELLED = "cancelled"  # its record now reads cancelled; it will not run to completion
    PENDING = "pending"  # no record of it yet: the marker stops it when it is delivered
    FINISHED = "finished"  # it had already ended: nothing was changed
    UNKNOWN = "unknown"  # no record where it looked, and no pending cancel asked: unchanged


@dataclass(frozen=True)
class Cancellation:
    """The answer to a cancel: what happened, and the task's record afterwards.

    Args:
        task_id: The task's id.
        outcome: What happened.
        state: The task's record afterwards: the ``cancelled`` one, the finished one that
            stays, or None when no record exists.
        elsewhere: When the cancel named a queue where the task has no record, its latest
            record in another queue (left as it was), else None.
    """

    task_id: str
    outcome: CancelOutcome
    state: TaskState | None
    elsewhere: TaskState | None = None

    @property
    def changed(self) -> bool:
        """False for a no-op: the task had already finished, or is not known."""
        return self.outcome not in (CancelOutcome.FINISHED, CancelOutcome.UNKNOWN)


@runtime_checkable
class RecordsSoon(Protocol):
    """A ``TaskStore`` that can start a record write at once, with no task of its own (the
    Redis store: its auto-pipeline sends it with the next batch). ``publish`` starts its
    "queued" record so, before the broker's confirm, and a round trip sooner."""

    def record_soon(self, state: TaskState, *, only_if_new: bool = False) -> Awaitable[Any]:
        """``record`` started now, sent with the store's next batch.

        Args:
            state: The record to write.
            only_if_new: Only where no record exists.

        Returns:
            A future that answers whether it was written, or fails with the store's error
            (unwrapped: the caller only logs it).
        """
        ...

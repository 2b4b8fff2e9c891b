"""``App``'s reading methods: a task's record and final state, its stream, a session's inbox,
cancelling, and the task index. Each is one call to the results reader
(``results.reader.ResultsReader``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from weclaw_mq.results.reader import ResultsReader
from weclaw_mq.state import Cancellation, TaskState
from weclaw_mq.state.steps import StepRecord
from weclaw_mq.state.task_index import TaskPage, TaskQuery, TimelineEvent
from weclaw_mq.streaming import Inbox, StreamEvent, StreamStore


class Reading:
    """What tasks did and are doing (``App`` inherits these methods)."""

    _reader: ResultsReader  # set by App.__init__

    async def status(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        """The task's recorded state in ``queue``.

        A task has one record per queue it went through (pipeline stages may share a task
        id).

        Args:
            task_id: The task's id.
            queue: The queue whose record answers; without it, the most recently written
                record of the task id.

        Returns:
            The record, or None if none is known. A stored_locally, queued or retrying record
            past the task's deadline answers ``expired``. With a local outbox, when the store has no
            record or does not answer, a task the outbox holds reads ``stored_locally``.

        Raises:
            ConfigurationError: Results are turned off (``WECLAW_MQ_RESULTS_ENABLED=false``).
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered the read with an error (not an outage).
        """
        return await self._reader.status(task_id, queue)

    async def result(
        self, task_id: str, *, queue: str | None = None, timeout_s: float = 60.0
    ) -> TaskState:
        """Wait until the task's record is final: succeeded, dead_lettered, expired or cancelled.

        It waits without polling in a loop: the store wakes it when the record is written.

        Args:
            task_id: The task's id.
            queue: The queue whose record answers; without it, the task's most recently
                written record. For a pipeline whose stages share a task id, pass the last
                stage's queue: without it, an earlier stage's final record may answer before
                the next stage wrote its own.
            timeout_s: How long to wait, in seconds.

        Returns:
            The final record.

        Raises:
            ResultTimeoutError: No final record within ``timeout_s`` (``.last`` holds the
                last record seen).
            ConfigurationError: Results are turned off (``WECLAW_MQ_RESULTS_ENABLED=false``).
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.result(task_id, queue, timeout_s)

    # -- streams and inboxes ------------------------------------------------------------
    @property
    def streams(self) -> StreamStore:
        """The stream store (task streams, session inboxes), opened on first use."""
        return self._reader.streams

    def stream(
        self, task_id: str, after: str | None = None, *, queue: str | None = None
    ) -> AsyncIterator[StreamEvent]:
        """The task's events, oldest first, then live, ending with its final event.

        Events are "attempt" (a run starts: drop the partial text so far), "chunk"
        (``data``) and "final" (``status``, ``result``, ``reason``). A task that is not known
        yet is waited for; bound it with ``asyncio.timeout``.

        Args:
            task_id: The task's id.
            after: The id of the last event already seen: resume with exactly the events
                after it.
            queue: Whose final state ends the stream, as ``result()`` answers it; without
                it, the task's latest record.

        Returns:
            An async iterator of the events. The final event comes for every terminal status,
            ``expired`` included.

        Raises:
            ConfigurationError: Results are turned off, or ``after`` is not a stream event
                id (raised here, not at the first event).
            StateUnavailableError: While iterating: Redis fails.
        """
        return self._reader.stream(task_id, after, queue)

    def inbox(self, session_id: str, *, after: str | None = None) -> Inbox:
        """The session's inbox.

        ``async for`` its pending events (oldest first, then live), and
        ``await inbox.confirm(event_id)`` to remove what the client received (up to and
        including that id).

        Args:
            session_id: The session (a user or a conversation).
            after: Start after this event id; default the oldest pending event.

        Returns:
            The inbox.

        Raises:
            ConfigurationError: An invalid ``session_id``, or an ``after`` that is not a
                stream event id.
        """
        return self._reader.inbox(session_id, after)

    async def cancel(
        self, task_id: str, *, queue: str | None = None, pending: bool = True
    ) -> Cancellation:
        """Cancel a task that has not finished.

        Queued or retrying, it is acked unrun when next delivered; running, its handler is
        cancelled within about a second on whichever worker runs it, and never retried. Its
        status becomes ``cancelled`` (final). A finished task is left alone. A task with no
        record in ``queue`` but one in another queue keeps that record and its status. See
        ``weclaw_mq.state.cancel_records``.

        Args:
            task_id: The task's id.
            queue: The queue to cancel it in. Without it, the task's latest record decides,
                and every queue of the task id is cancelled (all stages of a pipeline).
            pending: Cancel a task not known yet (in ``queue``, when given) when it
                arrives, for as long as a record is kept (``result_ttl_s``). With
                ``pending=False`` such a task is left alone.

        Returns:
            What happened: ``outcome`` is ``cancelled``; ``finished`` for a finished task
            (``changed`` False, with its record); ``pending`` for a task not known yet;
            ``unknown`` for one left alone with ``pending=False``. ``elsewhere`` is the
            task's record in another queue when ``queue`` holds none.

        Raises:
            ConfigurationError: A task id no task can have, an invalid queue name, or no
                task store (results off and no handler guarded).
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.cancel(task_id, queue, pending)

    # -- the task index (weclaw_mq.state.task_index) --------------------------------------
    async def tasks(self, query: TaskQuery | None = None) -> TaskPage:
        """One page of the tasks the store knows, newest first (the task index).

        A task is listed from its first record in a queue (published, stored in the local
        outbox, or first run) until the index's bounds drop it (``task_index_max_age_s``,
        ``task_index_max_entries``). One call examines at most a bounded number of entries:
        a filter that matches few tasks may answer a short page with a ``next_cursor`` to
        go on from.

        Args:
            query: The filters, page size and cursor; None: the newest 50 tasks.

        Returns:
            The page: its tasks with their records now, and the cursor of the next page
            (None when nothing older matches).

        Raises:
            ConfigurationError: Results are off, the task index is off
                (``WECLAW_MQ_TASK_INDEX=false``), or the store keeps none.
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.tasks(query if query is not None else TaskQuery())

    async def timeline(self, task_id: str, *, queue: str | None = None) -> list[TimelineEvent]:
        """What happened to a task: one event per record write, oldest first.

        Queued, running, retrying (with its error), succeeded, dead_lettered or expired
        (with the reason), cancelled; a task requeued from the DLQ reads queued again. Kept
        as long as its records, the last 100 events.

        Args:
            task_id: The task's id.
            queue: Only the events of this queue; without it, those of every queue.

        Returns:
            The events ([] when none are kept).

        Raises:
            ConfigurationError: A task id no task can have, an invalid queue name, results
                off or the task index off.
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.timeline(task_id, queue)

    # -- memoized steps (weclaw_mq.state.steps) -------------------------------------------
    async def steps(self, task_id: str, *, queue: str | None = None) -> list[StepRecord]:
        """The steps the task recorded (``ctx.step``), in the order they ran.

        Each with its name and occurrence, result, duration, the attempt that ran it and the
        model calls reported inside it; kept as long as the task's record.

        Args:
            task_id: The task's id.
            queue: The queue whose steps answer; without it, those of the task's most
                recently written record's queue.

        Returns:
            The steps ([] when none are kept, or the task has no record to say its queue).

        Raises:
            ConfigurationError: A task id no task can have, an invalid queue name, or no
                task store that keeps steps.
            StateUnavailableError: The store fails or does not answer.
            StateCommandError: Redis answered with an error (not an outage).
        """
        return await self._reader.steps(task_id, queue)

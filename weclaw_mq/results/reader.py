"""``ResultsReader``: an App's tasks as its user reads them: records (``status``, waited for by
``result``), task streams and session inboxes, and ``cancel``, the one write, which goes
through the task store like the records it changes and publishes nothing.

``App`` holds one and documents its public methods; this class knows the App only through what
its constructor is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from weclaw_mq.contract.naming import validate_queue_name, validate_session_id
from weclaw_mq.contract.task_ids import check_task_id
from weclaw_mq.errors import ConfigurationError, ResultTimeoutError
from weclaw_mq.settings import Settings
from weclaw_mq.state import (
    Cancellation,
    CancelOutcome,
    TaskState,
    TaskStatus,
    TaskStore,
    is_state_failure,
    state_unavailable,
)
from weclaw_mq.state.expiry import as_seen_at, until_deadline_s
from weclaw_mq.state.steps import HasSteps, StepRecord, steps_of
from weclaw_mq.state.task_index import TaskIndex, TaskPage, TaskQuery, TimelineEvent
from weclaw_mq.state.worker_registry import last_beat, registry_of, worker_gone
from weclaw_mq.streaming import Inbox, StreamEvent, StreamStore
from weclaw_mq.streaming.events import check_event_id
from weclaw_mq.streaming.reading import task_events

if TYPE_CHECKING:
    from weclaw_mq.outbox.fallback import LocalFallback

# result() re-reads a waiting task this long after its deadline, to answer "expired".
_DEADLINE_SLACK_S = 0.01


def _state_of(last: object) -> TaskState | None:
    return last if isinstance(last, TaskState) else None


class ResultsReader:
    """The results side of one App.

    Args:
        settings: The App's settings.
        results: The task store when results are on, else None.
        store: The task store whenever one is needed (cancels), else None.
        streams: A stream store given to the App (the caller closes it); None to open the
            default one on first use.
        local: The App's local outbox, None without one.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        results: Callable[[], TaskStore | None],
        store: Callable[[], TaskStore | None],
        streams: StreamStore | None,
        local: Callable[[], LocalFallback | None],
    ) -> None:
        self.settings = settings
        self._results = results
        # Cancel's: a store even with results off, when a handler is guarded.
        self._store = store
        self._local = local
        # Ours to open on first use and to close, unless the App was given one.
        self._streams, self._owns_streams = streams, streams is None

    def _require_results(self) -> TaskStore:
        store = self._results()
        if store is None:
            raise ConfigurationError(
                "results are turned off (WECLAW_MQ_RESULTS_ENABLED=false): no status to read"
            )
        return store

    # -- records ----------------------------------------------------------------------------
    async def status(self, task_id: str, queue: str | None) -> TaskState | None:
        """The task's record as ``App.status`` answers it."""
        local = self._local()
        if local is not None:
            return await local.status(task_id, queue, lambda: self._stored_status(task_id, queue))
        return await self._stored_status(task_id, queue)

    async def _stored_status(self, task_id: str, queue: str | None) -> TaskState | None:
        store = self._require_results()
        try:
            state = await store.get(task_id, queue=queue)
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise
        if state is not None and state.status is TaskStatus.RUNNING:
            state = await self._seen_running(store, state)
        # Past its deadline, a task nobody ran reads as expired (see state.expiry).
        return as_seen_at(state, datetime.now(UTC))

    async def _seen_running(self, store: TaskStore, state: TaskState) -> TaskState:
        """A ``running`` record with ``heartbeat_at`` when a live worker lists the task, or
        marked ``worker_gone`` when none runs it (the worker registry says so). Read only:
        the record is not rewritten. Not marked gone while it is younger than the registry's
        records live (its worker may not have beaten since it started), when the registry
        cannot tell, or cannot be read."""
        registry = registry_of(store)
        beat_s = self.settings.worker_beat_s
        if registry is None:
            return state
        try:
            workers = await registry.read()
        except Exception:  # best effort: the record as it stands
            return state
        now = datetime.now(UTC)
        beat = last_beat(workers, state.task_id, state.queue, now)
        if beat is not None:
            return state.model_copy(update={"heartbeat_at": beat})
        try:
            if not worker_gone(workers, state, beat_s, now):
                return state
            # Read again: a task that ended between the two reads is no longer running.
            again = await store.get(state.task_id, queue=state.queue)
        except Exception:  # best effort: the record as it stands
            return state
        if again is None or again.status is not TaskStatus.RUNNING:
            return again if again is not None else state
        if again.updated_at != state.updated_at:
            return again  # a new attempt started meanwhile
        return again.model_copy(update={"worker_gone": True})

    async def result(self, task_id: str, queue: str | None, timeout_s: float) -> TaskState:
        """The task's final record, waited for (``App.result``)."""
        store = self._require_results()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s
        try:
            while True:
                state = await self.status(task_id, queue)
                if state is not None and state.status.terminal:
                    return state
                # No worker may ever write again once the deadline passed (the broker
                # expired the task): wake up then too, to answer "expired".
                left = give_up - loop.time()
                until = until_deadline_s(state, datetime.now(UTC))
                if until is not None:
                    left = min(left, until + _DEADLINE_SLACK_S)
                try:
                    return await store.wait(task_id, max(left, 0.0), queue=queue)
                except ResultTimeoutError as e:
                    if loop.time() >= give_up:
                        final = as_seen_at(_state_of(e.last), datetime.now(UTC))
                        if final is not None and final.status.terminal:
                            return final
                        raise ResultTimeoutError(task_id, timeout_s, e.last) from None
        except Exception as e:
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    async def cancel(self, task_id: str, queue: str | None, pending: bool) -> Cancellation:
        """The task cancelled through the store (``App.cancel``)."""
        check_task_id(task_id)
        if queue is not None:
            validate_queue_name(queue)
        store = self._store()
        if store is None:
            raise ConfigurationError(
                "cancelling needs the task store: turn results on (WECLAW_MQ_RESULTS_ENABLED) "
                "or guard a handler (idempotent=True)"
            )
        try:
            if not pending and await store.get(task_id, queue=queue) is None:
                latest = await store.get(task_id) if queue is not None else None
                return Cancellation(task_id, CancelOutcome.UNKNOWN, None, latest)
            return await store.cancel(task_id, queue=queue)
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    # -- the task index (state.task_index) ----------------------------------------------
    def _require_index(self) -> TaskIndex:
        store = self._require_results()
        if not isinstance(store, TaskIndex):
            raise ConfigurationError(
                f"the task store ({type(store).__name__}) keeps no task index: "
                "listing tasks needs one that does (RedisTaskStore, MemoryTaskStore)"
            )
        return store

    async def tasks(self, query: TaskQuery) -> TaskPage:
        """One page of the task index (``App.tasks``)."""
        if query.queue is not None:
            validate_queue_name(query.queue)
        index = self._require_index()
        try:
            return await index.list_tasks(query)
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    async def timeline(self, task_id: str, queue: str | None) -> list[TimelineEvent]:
        """The task's record writes, oldest first (``App.timeline``)."""
        check_task_id(task_id)
        if queue is not None:
            validate_queue_name(queue)
        index = self._require_index()
        try:
            return await index.timeline(task_id, queue=queue)
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    # -- memoized steps (state.steps) ---------------------------------------------------
    async def steps(self, task_id: str, queue: str | None) -> list[StepRecord]:
        """The task's recorded steps in ``queue`` (default: its latest record's), in the order
        they ran (``App.steps``)."""
        check_task_id(task_id)
        if queue is not None:
            validate_queue_name(queue)
        store = self._store()
        if not isinstance(store, HasSteps):
            raise ConfigurationError(
                "steps are kept in the task store: "
                + (
                    "this App has none (results off and no handler guarded)"
                    if store is None
                    else f"{type(store).__name__} keeps none"
                )
            )
        try:
            if queue is None:
                latest = await store.get(task_id) if self._results() is not None else None
                if latest is None:
                    return []
                queue = latest.queue
            return steps_of(await store.step_book().load(queue, task_id))
        except Exception as e:  # a custom store on redis-py, unwrapped
            if is_state_failure(e):
                raise state_unavailable(e) from e
            raise

    # -- streams and inboxes ------------------------------------------------------------
    @property
    def streams(self) -> StreamStore:
        """The stream store, opened on first use (``App.streams``)."""
        if self._streams is None:
            from weclaw_mq.streaming.redis import (
                open_redis_streams,  # loads redis-py: only when used
            )

            self._streams = open_redis_streams(self.settings)
        return self._streams

    def _read_block_s(self) -> float:
        # How long one read waits (woken by a write) before the reader's loop takes its turn.
        return self.settings.redis_timeout_s / 2

    def stream(
        self, task_id: str, after: str | None, queue: str | None
    ) -> AsyncIterator[StreamEvent]:
        """The task's events, ending with its final one (``App.stream``)."""
        self._require_results()
        if after is not None:
            check_event_id(after)  # here, not at the first event: the caller's mistake

        def final_state(timeout_s: float) -> Awaitable[TaskState]:
            # The final state exactly as result() answers it (expired included).
            return self.result(task_id, queue, timeout_s)

        return task_events(
            self.streams,
            task_id,
            after,
            final_state=final_state,
            queue=queue,
            block_s=self._read_block_s(),
        )

    def inbox(self, session_id: str, after: str | None) -> Inbox:
        """The session's inbox (``App.inbox``)."""
        return Inbox(
            self.streams,
            validate_session_id(session_id),
            after=after,
            block_s=self._read_block_s(),
        )

    async def close(self) -> None:
        """Close the stream store if the reader opened it."""
        if self._streams is not None and self._owns_streams:
            streams, self._streams = self._streams, None
            await streams.close()

"""``TaskStore`` in this process's memory: the same rules as Redis, nothing shared.

For tests and single-process setups: a worker and the code that publishes and reads states
must run in one process (and one event loop, for ``wait``). Everything is lost when the
process ends, which is exactly what the guard must not do in production: use it where that
is what you want.

The rules match ``RedisTaskStore``: a claim lapses after ``lease_s`` unless its holder is
inside ``holding`` (its worker is this process, alive as long as the store: no heartbeat to
lapse); the first finish wins, a later one writes nothing; a done marker lasts
``done_ttl_s`` and records ``ttl_s``; every record write follows ``state.transitions``
(narrowed by ``only_if_new`` / ``only_over``); a cancel marker lasts ``ttl_s``
(``state.cancel_records``); every written record becomes the task's latest; ``wait`` is woken by an
event when a final record is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from weclaw_mq.contract.naming import index_member
from weclaw_mq.errors import ResultTimeoutError
from weclaw_mq.state.cancel_records import (
    answer,
    cancelled_record,
    covers,
    finished,
    other_record,
    scope_of,
)
from weclaw_mq.state.expiry import record_ttl_s
from weclaw_mq.state.fair_book import MemoryFairBook
from weclaw_mq.state.protocol import (
    Cancellation,
    CancelOutcome,
    Claim,
    Finish,
    TaskState,
    TaskStatus,
    TaskStore,
)
from weclaw_mq.state.reuse import FingerprintStore
from weclaw_mq.state.steps import MemoryStepBook
from weclaw_mq.state.task_index import (
    SPARSE_STATUSES,
    TIMELINE_MAX_EVENTS,
    TaskIndex,
    TaskPage,
    TaskQuery,
    TimelineEvent,
    index_off,
    read_timeline,
    scan_page,
    timeline_event,
    to_ms,
)
from weclaw_mq.state.transitions import may_follow, narrowing
from weclaw_mq.state.watches import WatchStep, is_stale, next_value
from weclaw_mq.state.workflow_records import HasWorkflows, MemoryWorkflowStore

_DONE = "done"  # a claim's holder once the task finished: no owner token is this


@dataclass
class _Entry:
    value: str  # a claim: its owner token or _DONE; a record: its state as JSON
    expires_at: float


@dataclass
class _Timeline:
    events: list[str]
    expires_at: float


@dataclass
class _Marker:
    expires_at: float
    scopes: set[str] = field(default_factory=set)


class MemoryTaskStore(TaskStore, TaskIndex, FingerprintStore, HasWorkflows):
    """A ``TaskStore`` in one process, with the Redis store's rules (for tests).

    Its methods do what the protocols it implements say, where their docstrings are written
    (``TaskStore``, ``TaskIndex``, ``FingerprintStore``, ``HasWorkflows``).

    Args:
        ttl_s: How long a record (and a cancel marker) is kept, in seconds; a record with a
            deadline is kept past it as ``state.expiry`` says.
        lease_s: A claim's lease, in seconds.
        done_ttl_s: How long a task stays done (copies acked unrun), in seconds.
        clock: Seconds, monotonic: lets tests make leases and TTLs lapse without waiting.
        task_index: Keep the task index and timelines (``state.task_index``).
        task_index_max_entries: The index's count bound.
        task_index_max_age_s: The index's age bound (wall clock), in seconds; 0: ``ttl_s``.
    """

    def __init__(
        self,
        *,
        ttl_s: float = 24 * 3600,
        lease_s: float = 30.0,
        done_ttl_s: float = 24 * 3600,
        clock: Callable[[], float] = time.monotonic,
        task_index: bool = True,
        task_index_max_entries: int = 1_000_000,
        task_index_max_age_s: float = 0,
    ) -> None:
        self._ttl_s = ttl_s
        self._lease_s = lease_s
        self._done_ttl_s = done_ttl_s
        self._clock = clock
        self._claims: dict[tuple[str, str], _Entry] = {}
        # Long runs' watch generations (state.watches); as long as the process, no TTL.
        self._watches: dict[tuple[str, str], int] = {}
        self._held: dict[tuple[str, str], str] = {}  # claims kept alive by ``holding``
        self._records: dict[tuple[str, str], _Entry] = {}
        self._fingerprints: dict[tuple[str, str], _Entry] = {}  # state.reuse
        self._latest: dict[str, _Entry] = {}  # task id -> queue of its latest record
        self._workflows = MemoryWorkflowStore()  # state.workflow_records
        self._steps = MemoryStepBook(ttl_s=ttl_s, clock=clock)  # state.steps
        self._fair_book = MemoryFairBook()  # state.fair_book
        self._finals: dict[str, asyncio.Event] = {}  # task id -> set when a record turns final
        self._markers: dict[str, _Marker] = {}  # task id -> its cancel marker
        self._cancel_watchers: list[Callable[[str, str | None], None]] = []
        # The task index: (queue, task id) -> when first recorded (ms), oldest first as the
        # writes came; the sparse statuses' own; the timelines by task id.
        self.task_index = task_index
        self._index_max = task_index_max_entries
        self._index_age_ms = int((task_index_max_age_s or ttl_s) * 1000)
        self._index: dict[tuple[str, str], int] = {}
        self._sparse: dict[TaskStatus, dict[tuple[str, str], int]] = {
            s: {} for s in SPARSE_STATUSES
        }
        self._timelines: dict[str, _Timeline] = {}

    def _live(self, table: dict[tuple[str, str], _Entry], key: tuple[str, str]) -> _Entry | None:
        entry = table.get(key)
        if entry is None:
            return None
        if table is self._claims and self._held.get(key) == entry.value:
            return entry  # its holder renews it for as long as the handler runs
        if entry.expires_at <= self._clock():
            del table[key]
            return None
        return entry

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
        if watch is not None and is_stale(self._watches.get((queue, task_id)), watch):
            return Claim.STALE
        if self._is_cancelled(queue, task_id):
            return Claim.CANCELLED
        key = (queue, task_id)
        current = self._live(self._claims, key)
        if current is None:
            self._claims[key] = _Entry(owner, self._clock() + self._lease_s)
            if running is not None:
                self._write(running, only_if_new=False)
            return Claim.ACQUIRED
        return Claim.DONE if current.value == _DONE else Claim.BUSY

    async def watch(self, queue: str, task_id: str, generation: int, step: WatchStep) -> int:
        key = (queue, task_id)
        value = self._watches[key] = next_value(self._watches.get(key), generation, step)
        return value

    @contextlib.contextmanager
    def holding(self, queue: str, task_id: str, owner: str) -> Iterator[None]:
        key = (queue, task_id)
        self._held[key] = owner
        try:
            yield
        finally:
            if self._held.get(key) == owner:
                del self._held[key]
                entry = self._claims.get(key)
                if entry is not None and entry.value == owner:
                    # Renewed up to now: the lease runs its full length from here.
                    entry.expires_at = self._clock() + self._lease_s

    async def release(self, queue: str, task_id: str, owner: str) -> None:
        key = (queue, task_id)
        current = self._live(self._claims, key)
        if current is not None and current.value == owner:
            del self._claims[key]

    async def finish(
        self, queue: str, task_id: str, result: TaskState | None, *, owner: str | None = None
    ) -> Finish:
        key = (queue, task_id)
        current = self._live(self._claims, key)
        if current is not None and current.value == _DONE:
            return Finish.DONE
        self._claims[key] = _Entry(_DONE, self._clock() + self._done_ttl_s)
        if result is not None:
            self._write(result, only_if_new=False)
        if owner is not None and current is not None and current.value != owner:
            return Finish.TAKEN
        return Finish.FINISHED

    # -- the records --------------------------------------------------------------------
    def _write(
        self,
        state: TaskState,
        *,
        only_if_new: bool,
        only_over: Collection[TaskStatus] | None = None,
    ) -> bool:
        key = (state.queue, state.task_id)
        current = self._live(self._records, key)
        status = None if current is None else TaskState.model_validate_json(current.value).status
        if not may_follow(status, state.status, only_over=narrowing(only_if_new, only_over)):
            return False
        expires_at = self._clock() + record_ttl_s(state, self._ttl_s, datetime.now(UTC))
        # Stored as JSON, as Redis does: a reader never shares an object with the writer.
        self._records[key] = _Entry(state.model_dump_json(), expires_at)
        self._latest[state.task_id] = _Entry(state.queue, expires_at)
        if self.task_index:
            self._index_write(state, key, created=current is None, expires_at=expires_at)
        if state.status.terminal:
            woken = self._finals.pop(state.task_id, None)
            if woken is not None:
                woken.set()
        return True

    def _index_write(
        self, state: TaskState, key: tuple[str, str], *, created: bool, expires_at: float
    ) -> None:
        """What the Redis store's ``index_write`` does (``state.redis_index``)."""
        timeline = self._timelines.get(state.task_id)
        if timeline is None or timeline.expires_at <= self._clock():
            timeline = self._timelines[state.task_id] = _Timeline([], expires_at)
        timeline.events = [*timeline.events, timeline_event(state)][-TIMELINE_MAX_EVENTS:]
        timeline.expires_at = expires_at
        at = to_ms(state.updated_at)
        if created and key not in self._index:
            self._index[key] = at
            self._trim_index()
        if state.status in SPARSE_STATUSES and key in self._index:
            self._sparse[state.status][key] = self._index[key]

    def _trim_index(self) -> None:
        # The oldest written go first (the Redis store: the lowest times; the same unless
        # records come with times out of order).
        oldest = to_ms(datetime.now(UTC)) - self._index_age_ms
        trimmed = False
        while self._index and (
            len(self._index) > self._index_max or next(iter(self._index.values())) < oldest
        ):
            del self._index[next(iter(self._index))]
            trimmed = True
        if trimmed:
            for sparse in self._sparse.values():
                for key in [k for k in sparse if k not in self._index]:
                    del sparse[key]

    async def list_tasks(self, query: TaskQuery) -> TaskPage:
        if not self.task_index:
            raise index_off()
        # The sorted set the Redis store reads for the query: a sparse status's, a queue's, all.
        index = self._sparse[query.status] if query.status in SPARSE_STATUSES else self._index
        of_queue = query.queue if index is self._index else None
        # Newest first, ties by member descending: the order Redis's ZRANGE ... REV gives.
        rows = sorted(
            (
                (at, index_member(*key), key)
                for key, at in index.items()
                if of_queue is None or key[0] == of_queue
            ),
            reverse=True,
        )

        async def entries(score: int, skip: int, count: int) -> list[tuple[str, str, int]]:
            below = [(key[0], key[1], at) for at, _, key in rows if at <= score]
            return below[skip : skip + count]

        async def records(tasks: list[tuple[str, str]]) -> list[str | bytes | None]:
            entries = [self._live(self._records, task) for task in tasks]
            return [e.value if e is not None else None for e in entries]

        return await scan_page(query, entries, records)

    async def timeline(self, task_id: str, *, queue: str | None = None) -> list[TimelineEvent]:
        if not self.task_index:
            raise index_off()
        timeline = self._timelines.get(task_id)
        if timeline is None or timeline.expires_at <= self._clock():
            return []
        return read_timeline(timeline.events, queue)

    async def record(
        self,
        state: TaskState,
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> bool:
        return self._write(state, only_if_new=only_if_new, only_over=only_over)

    async def record_many(
        self,
        states: Sequence[TaskState],
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> None:
        for state in states:
            self._write(state, only_if_new=only_if_new, only_over=only_over)

    async def forget_queued(self, queue: str, task_id: str) -> None:
        key = (queue, task_id)
        current = self._live(self._records, key)
        if current is None:
            return
        if TaskState.model_validate_json(current.value).status is not TaskStatus.QUEUED:
            return
        del self._records[key]
        latest = self._latest.get(task_id)
        if latest is not None and latest.value == queue:
            del self._latest[task_id]
        self._index.pop(key, None)  # a task the broker never held is not listed

    async def keep_fingerprint(
        self, queue: str, task_id: str, fingerprint: str, ttl_s: float
    ) -> str:
        key = (queue, task_id)
        kept = self._live(self._fingerprints, key)
        if kept is not None:
            return kept.value
        self._fingerprints[key] = _Entry(fingerprint, self._clock() + ttl_s)
        return fingerprint

    def _read(self, task_id: str, queue: str | None) -> TaskState | None:
        if queue is None:
            latest = self._latest.get(task_id)
            if latest is None or latest.expires_at <= self._clock():
                return None
            queue = latest.value
        entry = self._live(self._records, (queue, task_id))
        return TaskState.model_validate_json(entry.value) if entry is not None else None

    async def get(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        return self._read(task_id, queue)

    async def wait(self, task_id: str, timeout_s: float, *, queue: str | None = None) -> TaskState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            # No await between this read and taking the event: a final write lands either
            # before the read (we see it) or after (it sets the event we wait on).
            state = self._read(task_id, queue)
            if state is not None and state.status.terminal:
                return state
            left = deadline - loop.time()
            if left <= 0:
                raise ResultTimeoutError(task_id, timeout_s, state)
            final = self._finals.setdefault(task_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                # A final record of another queue also wakes us: one re-read.
                await asyncio.wait_for(final.wait(), left)

    # -- cancellation (state.cancel_records) ------------------------------------------------------
    async def cancel(self, task_id: str, *, queue: str | None = None) -> Cancellation:
        # No await from the read to the writes: the whole cancel is one step, as in Redis.
        state = self._read(task_id, queue)
        other = other_record(state, self._read(task_id, None), queue)
        now = datetime.now(UTC)
        done = finished(state, now)
        if done is not None:
            return Cancellation(task_id, CancelOutcome.FINISHED, done)
        marker = self._markers.get(task_id)
        if marker is None or marker.expires_at <= self._clock():
            marker = self._markers[task_id] = _Marker(0.0)
        marker.scopes.add(scope_of(queue))
        marker.expires_at = self._clock() + self._ttl_s
        written = cancelled_record(state, task_id, queue, now, other=other)
        if written is not None:
            self._write(written, only_if_new=False)
        for on_cancel in list(self._cancel_watchers):
            on_cancel(task_id, queue)
        return answer(task_id, written, other)

    def _is_cancelled(self, queue: str, task_id: str) -> bool:
        marker = self._markers.get(task_id)
        return (
            marker is not None
            and marker.expires_at > self._clock()
            and covers(marker.scopes, queue)
        )

    async def is_cancelled(self, queue: str, task_id: str) -> bool:
        return self._is_cancelled(queue, task_id)

    async def watch_cancels(
        self,
        on_cancel: Callable[[str, str | None], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        # Every cancel of this process reaches it from here on: one subscription, never lost.
        self._cancel_watchers.append(on_cancel)
        try:
            await on_subscribed()
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._cancel_watchers.remove(on_cancel)

    def fair_book(self) -> MemoryFairBook:
        """The fair-share book of this store (``state.fair_book``).

        Returns:
            The book, one per store.
        """
        return self._fair_book

    def workflow_store(self) -> MemoryWorkflowStore:
        return self._workflows

    def step_book(self) -> MemoryStepBook:
        """The tasks' memoized steps (``ctx.step``), kept ``ttl_s`` after a task's last step.

        Returns:
            The step book.
        """
        return self._steps

    async def close(self) -> None:
        return None  # nothing to release

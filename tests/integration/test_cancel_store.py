"""The cancel rules of ``state.cancel_records`` in both task stores (real Redis, and in
memory): what a cancel may overwrite, what may overwrite it, whom the marker stops, and who
hears of it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from tests.conftest import settings_for, wait_until
from weclaw_mq import CancelOutcome, MemoryTaskStore, TaskState, TaskStatus
from weclaw_mq.contract.naming import cancel_key, task_keys
from weclaw_mq.state import Claim, TaskStore, new_owner, open_store

QUEUES = ("t-cancel-a", "t-cancel-b")


@pytest.fixture(params=["redis", "memory"])
async def store(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[TaskStore]:
    chosen: TaskStore
    if request.param == "redis":
        chosen = open_store(settings_for("amqp://unused", redis_url, result_ttl_s=60))
    else:
        chosen = MemoryTaskStore(ttl_s=60)
    try:
        yield chosen
    finally:
        await chosen.close()


@pytest.fixture
async def new_id(redis_url: str) -> AsyncIterator[Callable[[], str]]:
    """Fresh task ids whose keys are deleted afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(str(uuid.uuid4()))
        return made[-1]

    yield make
    client = aioredis.Redis.from_url(redis_url)
    try:
        for tid in made:
            await client.delete(*[k for q in QUEUES for k in task_keys(q, tid)], cancel_key(tid))
    finally:
        await client.aclose()


@pytest.fixture
def task_id(new_id: Callable[[], str]) -> str:
    return new_id()


def _state(task_id: str, status: TaskStatus, **extra: object) -> TaskState:
    return TaskState(task_id=task_id, queue=QUEUES[0], status=status, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "status",
    [TaskStatus.SUCCEEDED, TaskStatus.DEAD_LETTERED, TaskStatus.EXPIRED, TaskStatus.CANCELLED],
)
async def test_a_cancel_never_overwrites_a_final_record(
    store: TaskStore, task_id: str, status: TaskStatus
) -> None:
    await store.record(
        _state(task_id, status, result=7 if status is TaskStatus.SUCCEEDED else None)
    )
    for queue in (None, QUEUES[0]):
        answer = await store.cancel(task_id, queue=queue)
        assert answer.outcome is CancelOutcome.FINISHED
        assert answer.state is not None and answer.state.status is status
    state = await store.get(task_id)
    assert state is not None and state.status is status
    if status is not TaskStatus.CANCELLED:
        assert not await store.is_cancelled(QUEUES[0], task_id)


async def test_a_waiting_record_past_its_deadline_is_expired_and_stays_so(
    store: TaskStore, task_id: str
) -> None:
    past = datetime.now(UTC) - timedelta(seconds=1)
    await store.record(_state(task_id, TaskStatus.QUEUED, expires_at=past))
    answer = await store.cancel(task_id)
    assert answer.outcome is CancelOutcome.FINISHED
    assert answer.state is not None and answer.state.status is TaskStatus.EXPIRED
    state = await store.get(task_id)
    assert state is not None and state.status is TaskStatus.QUEUED  # as the broker left it


async def test_cancelled_is_final_for_a_worker_that_ends_the_attempt_late(
    store: TaskStore, task_id: str
) -> None:
    owner = new_owner()
    running = _state(task_id, TaskStatus.RUNNING, attempt=1)
    assert await store.claim(QUEUES[0], task_id, owner, running=running) is Claim.ACQUIRED
    answer = await store.cancel(task_id)
    assert answer.outcome is CancelOutcome.CANCELLED
    assert answer.state is not None and answer.state.attempt == 1

    assert not await store.record(_state(task_id, TaskStatus.RETRYING))
    await store.finish(QUEUES[0], task_id, _state(task_id, TaskStatus.SUCCEEDED, result=1))
    state = await store.get(task_id, queue=QUEUES[0])
    assert state is not None and state.status is TaskStatus.CANCELLED and state.result is None


async def test_the_marker_stops_claims_in_its_queue_or_in_every_queue(
    store: TaskStore, task_id: str, new_id: Callable[[], str]
) -> None:
    a, b = QUEUES
    first = await store.cancel(task_id, queue=a)
    assert first.outcome is CancelOutcome.CANCELLED  # a record is written in the named queue
    assert await store.claim(a, task_id, new_owner()) is Claim.CANCELLED
    assert await store.is_cancelled(a, task_id) and not await store.is_cancelled(b, task_id)
    owner = new_owner()
    assert await store.claim(b, task_id, owner) is Claim.ACQUIRED
    await store.release(b, task_id, owner)

    everywhere = await store.cancel(task_id)
    # The latest record (a's, cancelled) is final already: nothing more is written or marked.
    assert everywhere.outcome is CancelOutcome.FINISHED
    # Of a task not known yet, every queue.
    other_id = new_id()
    pending = await store.cancel(other_id)
    assert pending.outcome is CancelOutcome.PENDING and pending.state is None
    for queue in QUEUES:
        assert await store.claim(queue, other_id, new_owner()) is Claim.CANCELLED
    assert await store.get(other_id) is None


async def test_a_cancel_wakes_result_waiters(store: TaskStore, task_id: str) -> None:
    await store.record(_state(task_id, TaskStatus.QUEUED))
    # Whether the waiter subscribed before the cancel or reads after it, it answers cancelled.
    waiter = asyncio.create_task(store.wait(task_id, 5))
    await store.cancel(task_id)
    state = await asyncio.wait_for(waiter, 3)
    assert state.status is TaskStatus.CANCELLED


async def test_watchers_hear_each_cancel_request(store: TaskStore, task_id: str) -> None:
    heard: list[tuple[str, str | None]] = []
    subscribed = asyncio.Event()

    async def on_subscribed() -> None:
        subscribed.set()

    watching = asyncio.create_task(
        store.watch_cancels(lambda t, q: heard.append((t, q)), on_subscribed)
    )
    try:
        await asyncio.wait_for(subscribed.wait(), 5)
        await store.record(_state(task_id, TaskStatus.RUNNING))
        await store.cancel(task_id, queue=QUEUES[0])
        await wait_until(lambda: heard, 3, what="the cancel request")
        assert heard == [(task_id, QUEUES[0])]
    finally:
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching


async def test_a_cancel_in_a_queue_without_its_record_leaves_the_record_elsewhere_alone(
    store: TaskStore, task_id: str
) -> None:
    a, b = QUEUES
    await store.record(_state(task_id, TaskStatus.RUNNING, attempt=1))

    answer = await store.cancel(task_id, queue=b)

    assert answer.outcome is CancelOutcome.PENDING and answer.state is None
    assert answer.elsewhere is not None and answer.elsewhere.queue == a
    assert answer.elsewhere.status is TaskStatus.RUNNING
    # status() still answers with the record in a: no cancelled record in b became the latest.
    state = await store.get(task_id)
    assert state is not None and state.queue == a and state.status is TaskStatus.RUNNING
    assert await store.get(task_id, queue=b) is None
    # Only b's deliveries are stopped.
    assert await store.is_cancelled(b, task_id) and not await store.is_cancelled(a, task_id)

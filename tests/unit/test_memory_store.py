"""The in-memory TaskStore keeps the Redis store's rules: leases lapse unless held, a done
marker and records expire, succeeded is final, only_if_new never overwrites, every written
record becomes the latest, and ``wait`` is woken by the write, not by polling."""

from __future__ import annotations

import asyncio

import pytest

from weclaw_mq import MemoryTaskStore, ResultTimeoutError, TaskState, TaskStatus
from weclaw_mq.state import Claim, Finish, TaskStore, new_owner

Q, OTHER_Q, T = "q", "q2", "task-1"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> MemoryTaskStore:
    return MemoryTaskStore(ttl_s=100, lease_s=30, done_ttl_s=50, clock=clock)


def state(status: TaskStatus, queue: str = Q, **fields: object) -> TaskState:
    return TaskState(task_id=T, queue=queue, status=status, **fields)  # type: ignore[arg-type]


def test_the_memory_store_is_a_task_store(store: MemoryTaskStore) -> None:
    typed: TaskStore = store
    assert typed is store


async def test_a_claim_is_granted_once_and_others_are_told_busy(store: MemoryTaskStore) -> None:
    first, second = new_owner(), new_owner()
    assert await store.claim(Q, T, first) is Claim.ACQUIRED
    assert await store.claim(Q, T, second) is Claim.BUSY
    # Per queue: the same task id in another queue is another task.
    assert await store.claim(OTHER_Q, T, second) is Claim.ACQUIRED


async def test_a_lease_lapses_unless_its_holder_is_holding_it(
    store: MemoryTaskStore, clock: Clock
) -> None:
    owner = new_owner()
    assert await store.claim(Q, T, owner) is Claim.ACQUIRED
    clock.now += 29
    assert await store.claim(Q, T, new_owner()) is Claim.BUSY
    clock.now += 2
    assert await store.claim(Q, T, new_owner()) is Claim.ACQUIRED, "the lease did not lapse"

    held = new_owner()
    assert await store.claim(OTHER_Q, T, held) is Claim.ACQUIRED
    with store.holding(OTHER_Q, T, held):
        clock.now += 300
        assert await store.claim(OTHER_Q, T, new_owner()) is Claim.BUSY
    # Leaving ``holding`` renews it once more: a full lease from here, then it lapses.
    clock.now += 29
    assert await store.claim(OTHER_Q, T, new_owner()) is Claim.BUSY
    clock.now += 2
    assert await store.claim(OTHER_Q, T, new_owner()) is Claim.ACQUIRED


async def test_only_the_holder_releases_a_claim(store: MemoryTaskStore) -> None:
    owner = new_owner()
    await store.claim(Q, T, owner)
    await store.release(Q, T, new_owner())
    assert await store.claim(Q, T, new_owner()) is Claim.BUSY
    await store.release(Q, T, owner)
    assert await store.claim(Q, T, new_owner()) is Claim.ACQUIRED


async def test_finish_marks_done_until_the_done_ttl_and_writes_the_result(
    store: MemoryTaskStore, clock: Clock
) -> None:
    owner = new_owner()
    await store.claim(Q, T, owner, running=state(TaskStatus.RUNNING))
    await store.finish(Q, T, state(TaskStatus.SUCCEEDED, result={"x": 1}))
    assert await store.claim(Q, T, new_owner()) is Claim.DONE
    # A late release by the old holder does not undo "done".
    await store.release(Q, T, owner)
    assert await store.claim(Q, T, new_owner()) is Claim.DONE
    got = await store.get(T, queue=Q)
    assert got is not None and (got.status, got.result) == (TaskStatus.SUCCEEDED, {"x": 1})
    clock.now += 51
    assert await store.claim(Q, T, new_owner()) is Claim.ACQUIRED


async def test_finish_without_a_result_marks_done_and_writes_no_record(
    store: MemoryTaskStore,
) -> None:
    await store.claim(Q, T, new_owner())
    await store.finish(Q, T, None)
    assert await store.claim(Q, T, new_owner()) is Claim.DONE
    assert await store.get(T) is None


async def test_the_running_record_is_written_only_when_the_claim_is_granted(
    store: MemoryTaskStore,
) -> None:
    await store.claim(Q, T, new_owner())
    assert await store.claim(Q, T, new_owner(), running=state(TaskStatus.RUNNING)) is Claim.BUSY
    assert await store.get(T, queue=Q) is None
    assert await store.claim(OTHER_Q, T, new_owner(), running=state(TaskStatus.RUNNING, OTHER_Q))
    got = await store.get(T, queue=OTHER_Q)
    assert got is not None and got.status is TaskStatus.RUNNING


async def test_succeeded_is_final_and_dead_lettered_is_not(store: MemoryTaskStore) -> None:
    assert await store.record(state(TaskStatus.SUCCEEDED, result=1))
    for late in (TaskStatus.RUNNING, TaskStatus.RETRYING, TaskStatus.DEAD_LETTERED):
        assert not await store.record(state(late))
    await store.finish(Q, T, state(TaskStatus.SUCCEEDED, result=2))
    got = await store.get(T, queue=Q)
    assert got is not None and got.result == 1

    # A dead letter may be requeued by an operator and then succeed.
    assert await store.record(state(TaskStatus.DEAD_LETTERED, OTHER_Q, reason="rejected"))
    assert await store.record(state(TaskStatus.QUEUED, OTHER_Q))
    assert await store.record(state(TaskStatus.SUCCEEDED, OTHER_Q))


async def test_queued_never_overwrites_a_record_and_never_moves_the_latest(
    store: MemoryTaskStore,
) -> None:
    assert await store.record(state(TaskStatus.RUNNING, attempt=2))
    assert not await store.record(state(TaskStatus.QUEUED), only_if_new=True)
    await store.record_many([state(TaskStatus.QUEUED)], only_if_new=True)
    got = await store.get(T)
    assert got is not None and (got.status, got.attempt) == (TaskStatus.RUNNING, 2)


async def test_the_latest_record_answers_a_read_without_a_queue(store: MemoryTaskStore) -> None:
    await store.record(state(TaskStatus.RUNNING, Q))
    await store.record(state(TaskStatus.QUEUED, OTHER_Q), only_if_new=True)
    latest = await store.get(T)
    assert latest is not None and latest.queue == OTHER_Q
    await store.record(state(TaskStatus.SUCCEEDED, Q))
    latest = await store.get(T)
    assert latest is not None and (latest.queue, latest.status) == (Q, TaskStatus.SUCCEEDED)


async def test_forget_queued_drops_only_a_queued_record_and_its_latest_pointer(
    store: MemoryTaskStore,
) -> None:
    await store.record(state(TaskStatus.RUNNING, Q))
    await store.forget_queued(Q, T)
    assert await store.get(T, queue=Q) is not None, "a running record was forgotten"

    await store.record(state(TaskStatus.QUEUED, OTHER_Q), only_if_new=True)
    await store.forget_queued(OTHER_Q, T)
    assert await store.get(T, queue=OTHER_Q) is None
    assert await store.get(T) is None, "the latest pointer still names the forgotten record"
    assert (await store.get(T, queue=Q)) is not None


async def test_records_expire_after_their_ttl(store: MemoryTaskStore, clock: Clock) -> None:
    await store.record(state(TaskStatus.SUCCEEDED))
    clock.now += 99
    assert await store.get(T) is not None
    clock.now += 2
    assert await store.get(T) is None
    assert await store.get(T, queue=Q) is None
    assert await store.record(state(TaskStatus.QUEUED), only_if_new=True)


async def test_a_stored_record_is_a_copy(store: MemoryTaskStore) -> None:
    written = state(TaskStatus.SUCCEEDED, result={"items": [1]})
    await store.record(written)
    written.result["items"].append(2)
    got = await store.get(T)
    assert got is not None and got.result == {"items": [1]}


async def test_wait_is_woken_by_the_final_write_not_by_a_poll(store: MemoryTaskStore) -> None:
    await store.record(state(TaskStatus.RUNNING))
    waiting = asyncio.create_task(store.wait(T, 60, queue=Q))
    await asyncio.sleep(0)  # let it read "running" and wait
    assert not waiting.done()
    await store.record(state(TaskStatus.RETRYING))
    await asyncio.sleep(0)
    assert not waiting.done()
    # Woken within a few loop turns (no poll interval exists to wait for).
    await store.finish(Q, T, state(TaskStatus.SUCCEEDED, result="ok"))
    done = await asyncio.wait_for(waiting, 1)
    assert (done.status, done.result) == (TaskStatus.SUCCEEDED, "ok")


async def test_wait_for_one_queue_ignores_a_final_record_of_another(
    store: MemoryTaskStore,
) -> None:
    waiting = asyncio.create_task(store.wait(T, 60, queue=OTHER_Q))
    await asyncio.sleep(0)
    await store.record(state(TaskStatus.SUCCEEDED, Q))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await store.record(state(TaskStatus.DEAD_LETTERED, OTHER_Q, reason="rejected"))
    done = await asyncio.wait_for(waiting, 1)
    assert (done.queue, done.status) == (OTHER_Q, TaskStatus.DEAD_LETTERED)


async def test_wait_times_out_with_the_last_state_seen(store: MemoryTaskStore) -> None:
    await store.record(state(TaskStatus.RETRYING))
    with pytest.raises(ResultTimeoutError) as raised:
        await store.wait(T, 0.05)
    assert isinstance(raised.value.last, TaskState)
    assert raised.value.last.status is TaskStatus.RETRYING


async def test_the_first_finish_wins_and_a_finish_by_a_lost_claim_is_told_so(
    store: MemoryTaskStore, clock: Clock
) -> None:
    early, late = new_owner(), new_owner()
    assert await store.claim(Q, T, early) is Claim.ACQUIRED
    clock.now += 31  # the early attempt's lease lapsed (nothing held it)
    assert await store.claim(Q, T, late, running=state(TaskStatus.RUNNING)) is Claim.ACQUIRED
    taken = await store.finish(Q, T, state(TaskStatus.SUCCEEDED, result=1), owner=early)
    assert taken is Finish.TAKEN
    done = await store.finish(Q, T, state(TaskStatus.SUCCEEDED, result=2), owner=late)
    assert done is Finish.DONE
    got = await store.get(T, queue=Q)
    assert got is not None and got.result == 1
    # The holder's own finish.
    owner = new_owner()
    assert await store.claim(OTHER_Q, T, owner) is Claim.ACQUIRED
    assert await store.finish(OTHER_Q, T, None, owner=owner) is Finish.FINISHED

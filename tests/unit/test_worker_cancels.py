"""A worker's view of cancel requests (``worker.cancel_watch``), in one process on the in-memory
store: which deliveries a request reaches, and a request sent while nobody listened."""

from __future__ import annotations

import asyncio

import pytest

from weclaw_mq import MemoryTaskStore, TaskState, TaskStatus
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.deadlines import Deadlines


def test_a_request_reaches_the_deliveries_of_its_task_in_its_queue_or_in_every_queue() -> None:
    cancels = Cancels()
    in_a, in_b, other = cancels.watch("a", "t1"), cancels.watch("b", "t1"), cancels.watch("a", "t2")
    cancels.request("t1", "a")
    assert (in_a.requested, in_b.requested, other.requested) == (True, False, False)
    cancels.request("t1", None)
    assert (in_b.requested, other.requested) == (True, False)
    cancels.unwatch(other)
    cancels.request("t2", None)  # ended: nothing to reach
    assert not other.requested


async def test_a_request_that_came_before_the_handler_started_cuts_it_short_at_once() -> None:
    cancels, deadlines = Cancels(), Deadlines()
    watch = cancels.watch("a", "t1")
    cancels.request("t1", None)
    event = watch.event()
    assert event.is_set()
    with pytest.raises(TimeoutError), deadlines.within(30) as deadline:
        watch.attach(deadline)
        await asyncio.sleep(30)
    assert deadline.expired


async def test_a_cancel_sent_while_nobody_listened_is_found_when_listening_starts() -> None:
    store = MemoryTaskStore()
    await store.record(TaskState(task_id="t1", queue="a", status=TaskStatus.RUNNING))
    cancels = Cancels()
    watch = cancels.watch("a", "t1")
    untouched = cancels.watch("b", "t1")
    await store.cancel("t1", queue="a")  # no listener yet: the request itself is lost
    assert not watch.requested

    listening = asyncio.create_task(cancels.listen(store))
    try:
        await asyncio.wait_for(cancels.listening.wait(), 5)
        assert watch.requested and not untouched.requested
        await store.cancel("t1", queue="b")  # now heard as it is sent
        assert untouched.requested
    finally:
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening

"""``App.cancel`` refuses a task id no task can have and an invalid queue name before it writes
anything: an empty id, or one with a newline or NUL, would otherwise leave a cancel marker
under a key no task uses, and a typo'd queue one for a queue that does not exist."""

from __future__ import annotations

import pytest

from weclaw_mq import App, ConfigurationError, MemoryTaskStore, TaskState, TaskStatus
from weclaw_mq.state import CancelOutcome


@pytest.mark.parametrize("task_id", ["", "a\nb", "a\x00b", "tab\there", "x" * 256], ids=repr)
async def test_a_task_id_no_task_can_have_is_refused_and_nothing_is_marked(task_id: str) -> None:
    store = MemoryTaskStore()
    app = App("t", store=store)

    with pytest.raises(ConfigurationError, match="task id"):
        await app.cancel(task_id)
    assert not await store.is_cancelled("q", task_id)


@pytest.mark.parametrize("queue", ["", "has space", "q.dlq", "amq.q", "x" * 201], ids=repr)
async def test_an_invalid_queue_name_is_refused_and_nothing_is_marked(queue: str) -> None:
    store = MemoryTaskStore()
    app = App("t", store=store)

    with pytest.raises(ConfigurationError, match="queue name"):
        await app.cancel("task-1", queue=queue)
    assert not await store.is_cancelled(queue, "task-1")


async def test_without_pending_an_unknown_task_is_left_alone_and_the_other_record_named() -> None:
    store = MemoryTaskStore()
    app = App("t", store=store)
    await store.record(TaskState(task_id="t1", queue="a", status=TaskStatus.RUNNING))

    nowhere = await app.cancel("t2", pending=False)
    wrong = await app.cancel("t1", queue="b", pending=False)

    assert nowhere.outcome is CancelOutcome.UNKNOWN and not nowhere.changed
    assert nowhere.elsewhere is None
    assert wrong.outcome is CancelOutcome.UNKNOWN and wrong.elsewhere is not None
    assert wrong.elsewhere.queue == "a"
    for queue in ("a", "b"):
        assert not await store.is_cancelled(queue, "t1")
        assert not await store.is_cancelled(queue, "t2")

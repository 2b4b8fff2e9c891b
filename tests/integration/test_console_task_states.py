"""What the console's task page says of a task that waits or whose worker is gone (real
broker and Redis): a deferral recorded on a ``queued`` record (what deferred it, how often,
its next try), and a ``running`` record that no live worker runs (its worker was killed)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from tests.conftest import forget_task_keys
from tests.integration.console_live import (  # noqa: F401
    LiveConsole,
    console_access,
    console_trace_url,
    live_console,
)
from weclaw_mq.state import Deferral, TaskState, TaskStatus


async def test_the_task_page_says_why_a_queued_task_was_deferred_and_when_it_tries_again(
    live_console: LiveConsole,  # noqa: F811
    redis_url: str,
) -> None:
    app, queue = live_console.console_app, live_console.queue
    task_id = uuid.uuid4().hex
    next_try = datetime.now(UTC) + timedelta(seconds=30)
    deferral = Deferral(by="limit", why="over its rate limit", next_try_at=next_try, count=3)
    try:
        state = TaskState(task_id=task_id, queue=queue, status=TaskStatus.QUEUED)
        assert await app.store.record(state.model_copy(update={"deferred": deferral}))
        page = await live_console.client.get(f"/tasks/{task_id}?queue={queue}")
        assert page.status_code == 200
        assert 'id="record-deferred"' in page.text, page.text
        assert "deferred (limit, 3 times, no attempt spent): over its rate limit" in page.text
        assert "next try" in page.text
    finally:
        await forget_task_keys(redis_url, [queue])


async def test_the_task_page_says_a_running_task_is_on_a_worker_that_is_gone(
    live_console: LiveConsole,  # noqa: F811
    redis_url: str,
) -> None:
    app, queue = live_console.console_app, live_console.queue
    task_id = uuid.uuid4().hex
    # Written an hour ago by a worker no longer in the registry (no worker runs here): older
    # than four of the longest beat any live worker on the shared Redis may have (300 s).
    started = datetime.now(UTC) - timedelta(hours=1)
    try:
        state = TaskState(task_id=task_id, queue=queue, status=TaskStatus.RUNNING, attempt=1)
        assert await app.store.record(state.model_copy(update={"updated_at": started}))
        page = await live_console.client.get(f"/tasks/{task_id}?queue={queue}")
        assert page.status_code == 200
        assert 'id="record-worker-gone"' in page.text, page.text
        assert "running on a worker that is gone" in page.text
        stored = await app.store.get(task_id, queue=queue)
        assert stored is not None and stored.status is TaskStatus.RUNNING  # not rewritten
    finally:
        await forget_task_keys(redis_url, [queue])

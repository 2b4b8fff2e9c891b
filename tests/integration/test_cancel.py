"""Cancelling a task (``App.cancel``, ``weclaw-mq cancel``) on the real broker and Redis: a
queued, a retrying, a running and a finished task, and one not published yet. None runs to
completion after its cancel returned; statuses and outcomes are right (``state.cancel_records``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel

from tests.conftest import ignoring_cancels, outcome_count, queue_depth, settings_for, wait_until
from tests.integration.dead_endpoints import closed_port
from tests.integration.processes import one_error_line, run_cli, settings_env
from weclaw_mq import App, CancelOutcome, Context, RetryPolicy, TaskStatus
from weclaw_mq.observability.metrics import Outcome

# The retry comes back soon, so a test sees what the worker does with it when it does.
RETRY_SOON = RetryPolicy(max_retries=3, delay_s=1.0)
# The bound the issue sets for a running handler to see its cancel.
CANCEL_WITHIN_S = 1.0


async def _acked_as_cancelled(app: App, queue: str, n: int = 1) -> None:
    await wait_until(
        lambda: outcome_count(app, queue, Outcome.CANCELLED) == n,
        10,
        what=f"{n} delivery(ies) of {queue} acked as cancelled",
    )


async def test_a_queued_task_cancelled_before_any_worker_runs_is_acked_unrun(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
) -> None:
    app = make_app()
    ran: list[int] = []

    @app.handler(qname)
    async def handle(task: dict[str, int]) -> int:
        ran.append(task["n"])
        return task["n"]

    await app.declare()
    doomed = await app.publish(qname, {"n": 1})
    answer = await app.cancel(doomed)
    assert answer.outcome is CancelOutcome.CANCELLED and answer.changed
    assert answer.state is not None and answer.state.queue == qname
    state = await app.status(doomed)
    assert state is not None and state.status is TaskStatus.CANCELLED

    other = await app.publish(qname, {"n": 2})
    await start_worker(app, concurrency=1)
    assert (await app.result(other, timeout_s=10)).result == 2
    await _acked_as_cancelled(app, qname)
    assert ran == [2]
    assert await queue_depth(amqp, qname) == 0
    final = await app.result(doomed, timeout_s=1)
    assert final.status is TaskStatus.CANCELLED and final.result is None


async def test_a_retrying_task_cancelled_in_its_delay_queue_is_acked_when_it_comes_back(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
) -> None:
    app = make_app()
    attempts: list[int] = []

    @app.handler(qname, retry=RETRY_SOON)
    async def flaky(task: dict[str, int], ctx: Context) -> None:
        attempts.append(ctx.attempt)
        raise RuntimeError("the model API is down")

    await app.declare()
    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})

    async def retrying() -> bool:
        state = await app.status(task_id)
        return state is not None and state.status is TaskStatus.RETRYING

    await wait_until(retrying, 10, what="the task in its delay queue")
    answer = await app.cancel(task_id)
    assert answer.outcome is CancelOutcome.CANCELLED
    await _acked_as_cancelled(app, qname)

    assert attempts == [1]
    assert outcome_count(app, qname, Outcome.RETRIED) == 1
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED
    # (The delay queues are the vhost's, shared with other tests: not counted here.)
    assert await queue_depth(amqp, qname) == 0


@pytest.mark.parametrize("reaction", ["re-raises", "raises_its_own_error"])
async def test_a_running_handler_is_cancelled_within_a_second_and_never_retried(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    amqp: AbstractChannel,
    qname: str,
    reaction: str,
) -> None:
    app = make_app()
    started = asyncio.Event()
    cancelled_at: list[float] = []
    flag_seen: list[bool] = []
    completed: list[bool] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=0.2))
    async def generate(task: dict[str, int], ctx: Context) -> str:
        started.set()
        try:
            await asyncio.sleep(30)  # the model streaming its answer
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            flag_seen.append(ctx.cancelled and ctx.cancel_requested.is_set())
            if reaction == "re-raises":
                raise
            raise RuntimeError("the clean-up failed too") from None
        completed.append(True)
        return "the whole answer"

    await app.declare()
    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    await asyncio.wait_for(started.wait(), 10)

    asked = time.monotonic()
    answer = await app.cancel(task_id)
    assert answer.outcome is CancelOutcome.CANCELLED
    await wait_until(lambda: cancelled_at, 5, what="the handler's CancelledError")
    took_s = cancelled_at[0] - asked
    assert took_s < CANCEL_WITHIN_S, f"the handler saw its cancel after {took_s:.3f} s"
    assert flag_seen == [True]

    await _acked_as_cancelled(app, qname)
    assert completed == []
    assert outcome_count(app, qname, Outcome.RETRIED) == 0
    final = await app.result(task_id, timeout_s=1)
    assert final.status is TaskStatus.CANCELLED
    assert await queue_depth(amqp, qname) == 0


async def test_cancelling_a_finished_task_changes_nothing_and_says_so(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()

    @app.handler(qname)
    async def handle(task: dict[str, int]) -> int:
        return task["n"] * 2

    await app.declare()
    await start_worker(app)
    task_id = await app.publish(qname, {"n": 21})
    assert (await app.result(task_id, timeout_s=10)).result == 42

    for queue in (None, qname):
        answer = await app.cancel(task_id, queue=queue)
        assert answer.outcome is CancelOutcome.FINISHED and not answer.changed
        assert answer.state is not None and answer.state.status is TaskStatus.SUCCEEDED
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.SUCCEEDED and state.result == 42


@pytest.mark.parametrize("named_queue", [False, True], ids=["any_queue", "its_queue"])
async def test_a_cancel_that_comes_before_its_task_was_published_still_wins(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    named_queue: bool,
) -> None:
    app = make_app()
    ran: list[str] = []

    @app.handler(qname)
    async def handle(task: dict[str, str]) -> None:
        ran.append(task["id"])

    await app.declare()
    await start_worker(app)
    task_id = str(uuid.uuid4())
    answer = await app.cancel(task_id, queue=qname if named_queue else None)
    if named_queue:
        assert answer.outcome is CancelOutcome.CANCELLED
        assert answer.state is not None and answer.state.status is TaskStatus.CANCELLED
    else:
        assert answer.outcome is CancelOutcome.PENDING and answer.state is None

    await app.publish(qname, {"id": task_id}, task_id=task_id)
    await _acked_as_cancelled(app, qname)
    assert ran == []
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED


async def test_the_cancel_command_cancels_says_when_there_was_nothing_to_cancel_and_fails_in_one_line(  # noqa: E501
    make_app: Callable[..., App], broker_url: str, redis_url: str, qname: str, tmp_path: Path
) -> None:
    app = make_app()

    @app.handler(qname)
    async def handle(task: dict[str, int]) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    task_id = await app.publish(qname, {"n": 1})
    env = settings_env(settings_for(broker_url, redis_url))

    done = await run_cli("cancel", task_id, env=env)
    assert done.code == 0, done.stderr
    assert done.stdout.strip() == f"task {task_id} cancelled in queue {qname}"
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED

    again = await run_cli("cancel", task_id, "--queue", qname, env=env)
    assert again.code == 1
    assert one_error_line(again) == (
        f"weclaw-mq: error: task {task_id} already ended (cancelled); nothing was cancelled"
    )

    dead_redis = settings_env(
        settings_for(broker_url, f"redis://127.0.0.1:{closed_port()}/0", redis_timeout_s=1)
    )
    down = await run_cli("cancel", task_id, env=dead_redis)
    assert down.code == 5
    assert "Redis did not answer" in one_error_line(down)


async def test_a_handler_that_ignores_its_cancel_is_left_behind_and_the_task_acked_as_cancelled(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(handler_cancel_grace_s=0.3)
    started = asyncio.Event()
    release = asyncio.Event()  # set at the end: the stubborn handler may then return
    completed: list[bool] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=3, delay_s=0.2))
    async def stubborn(task: dict[str, int]) -> str:
        started.set()
        await ignoring_cancels(release)
        completed.append(True)
        return "too late"

    worker = await start_worker(app, concurrency=1)
    try:
        task_id = await app.publish(qname, {"n": 1})
        await asyncio.wait_for(started.wait(), 10)
        await app.cancel(task_id)
        await _acked_as_cancelled(app, qname)
        # The ack is counted inside the delivery's task; its slot is freed as that task ends.
        await wait_until(lambda: worker.in_flight == 0, 5, "the cancelled delivery's slot")
        assert worker.abandoned == 1
        assert outcome_count(app, qname, Outcome.RETRIED) == 0
    finally:
        release.set()
    await wait_until(lambda: worker.abandoned == 0, 5, "the abandoned handler to end")
    # Its late return changed nothing.
    assert completed == [True]
    state = await app.status(task_id)
    assert state is not None and state.status is TaskStatus.CANCELLED and state.result is None


async def test_a_cancel_into_the_wrong_queue_says_where_the_task_runs_and_stops_nothing(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    broker_url: str,
    redis_url: str,
    qname: str,
) -> None:
    app = make_app()
    started: dict[str, Context] = {}
    release = asyncio.Event()

    @app.handler(qname)
    async def handle(task: dict[str, str], ctx: Context) -> str:
        started[task["id"]] = ctx
        await asyncio.wait_for(release.wait(), 30)
        return task["id"]

    await app.declare()
    await start_worker(app, concurrency=2)
    wrong, right = str(uuid.uuid4()), str(uuid.uuid4())
    for task_id in (wrong, right):
        await app.publish(qname, {"id": task_id}, task_id=task_id)
    await wait_until(lambda: len(started) == 2, 10, what="both handlers running")
    env = settings_env(settings_for(broker_url, redis_url))
    typo = f"{qname}-typo"

    refused = await run_cli("cancel", wrong, "--queue", typo, env=env)
    assert refused.code == 1, refused
    line = one_error_line(refused)
    assert f"no record in queue {typo}" in line and f"queue {qname} (running)" in line, line
    assert "nothing was cancelled" in line
    marked = await run_cli("cancel", wrong, "--queue", typo, "--pending", env=env)
    assert marked.code == 0, marked.stderr
    assert f"queue {qname} (running), left as it is" in marked.stdout, marked.stdout
    state = await app.status(wrong)
    assert state is not None and state.queue == qname and state.status is TaskStatus.RUNNING

    # The right queue still cancels. Its request follows the wrong ones on the one channel
    # the worker hears, so once it landed, the wrong ones had been heard too.
    done = await run_cli("cancel", right, "--queue", qname, env=env)
    assert done.code == 0, done.stderr
    await _acked_as_cancelled(app, qname)
    assert not started[wrong].cancelled
    release.set()
    final = await app.result(wrong, timeout_s=10)
    assert final.status is TaskStatus.SUCCEEDED and final.result == wrong


async def test_cancel_of_an_unknown_task_fails_unless_a_pending_cancel_is_asked_for(
    make_app: Callable[..., App], broker_url: str, redis_url: str, qname: str
) -> None:
    app = make_app()

    @app.handler(qname)
    async def handle(task: dict[str, int]) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    env = settings_env(settings_for(broker_url, redis_url))
    task_id = str(uuid.uuid4())

    unknown = await run_cli("cancel", task_id, env=env)
    assert unknown.code == 1
    assert one_error_line(unknown) == (
        f"weclaw-mq: error: task {task_id} is not known: nothing was cancelled "
        "(--pending cancels it for when it arrives)"
    )
    assert not await app.store.is_cancelled(qname, task_id)  # type: ignore[union-attr]

    pending = await run_cli("cancel", task_id, "--pending", env=env)
    assert pending.code == 0, pending.stderr
    assert "cancelled in every queue for when it arrives" in pending.stdout
    await app.publish(qname, {"n": 1}, task_id=task_id)  # its keys are then cleaned up with q's
    assert await app.store.is_cancelled(qname, task_id)  # type: ignore[union-attr]

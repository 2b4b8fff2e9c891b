"""Task state per (queue, task id): pipeline stages that share a task id keep their own record
and their own guard, and reading a state says clearly when Redis is not there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import outcome_count, settings_for, wait_until
from tests.integration.dead_endpoints import closed_port, silent_server
from tests.private_servers import PrivateRedis
from weclaw_mq import App, Context, StateUnavailableError, TaskState, TaskStatus
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import task_keys
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.state import RedisTaskStore


class Step(BaseModel):
    n: int = 0


@pytest.fixture
async def forget_keys(redis_client: aioredis.Redis) -> AsyncIterator[list[tuple[str, str]]]:
    """(queue, task id) pairs whose Redis keys are deleted at teardown."""
    pairs: list[tuple[str, str]] = []
    yield pairs
    keys = [k for queue, task_id in pairs for k in task_keys(queue, task_id)]
    if keys:
        await redis_client.delete(*keys)


def _two_stage_app(make_app: Callable[..., App], first: str, second: str) -> tuple[App, list[str]]:
    """Stage 1 on ``first`` hands the same task id on to stage 2 on ``second``."""
    app = make_app(max_retries=0)
    second_runs: list[str] = []

    @app.handler(first)
    async def stage_one(task: Step, ctx: Context) -> dict[str, Any]:
        await ctx.publish(second, Step(n=task.n + 1), task_id=ctx.task_id)
        return {"stage": 1}

    @app.handler(second)
    async def stage_two(task: Step, ctx: Context) -> dict[str, Any]:
        second_runs.append(ctx.task_id)
        return {"stage": 2, "n": task.n}

    return app, second_runs


async def test_a_second_stage_sharing_the_task_id_keeps_its_own_result(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget_keys: list[tuple[str, str]],
) -> None:
    first, second = f"{qname}-one", f"{qname}-two"
    app, second_runs = _two_stage_app(make_app, first, second)
    await app.declare()
    # Stage 2 runs only once stage 1's record is final: then "latest" is stage 2 for sure.
    await start_worker(app, queues=[first])
    task_id = await app.publish(first, Step(n=1))
    forget_keys += [(first, task_id), (second, task_id)]
    one = await app.result(task_id, queue=first, timeout_s=10)
    assert one.status is TaskStatus.SUCCEEDED and one.result == {"stage": 1}

    await start_worker(app, queues=[second])

    async def second_stage_is_latest() -> bool:
        state = await app.status(task_id)
        return state is not None and state.queue == second and state.status.terminal

    await wait_until(second_stage_is_latest, 10, "the second stage's record to be the latest")
    latest = await app.status(task_id)
    assert latest is not None and latest.result == {"stage": 2, "n": 2}, latest
    assert second_runs == [task_id]
    # Each stage's record stays readable by its queue.
    two = await app.result(task_id, queue=second, timeout_s=5)
    assert two.result == {"stage": 2, "n": 2}
    kept = await app.status(task_id, queue=first)
    assert kept is not None and kept.result == {"stage": 1}


async def test_a_redelivered_copy_of_a_later_stage_runs_although_an_earlier_stage_succeeded(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget_keys: list[tuple[str, str]],
) -> None:
    first, second = f"{qname}-one", f"{qname}-two"
    app, second_runs = _two_stage_app(make_app, first, second)
    await app.declare()
    task_id = "shared-" + qname
    forget_keys += [(first, task_id), (second, task_id)]
    await start_worker(app, queues=[second])
    # Stage 1's success is on record; then a copy of stage 2 that looks returned unsettled
    # once (its worker died) arrives: it must run, not be taken for a finished duplicate.
    store = app.results
    assert store is not None
    await store.record(
        TaskState(task_id=task_id, queue=first, status=TaskStatus.SUCCEEDED, result={"stage": 1})
    )
    await app.publish(second, Step(n=5), task_id=task_id, headers={h.RETURNS: 1})

    await wait_until(lambda: second_runs == [task_id], 10, "stage 2's handler to run")
    state = await app.result(task_id, queue=second, timeout_s=10)
    assert state.result == {"stage": 2, "n": 5}
    assert outcome_count(app, second, Outcome.DUPLICATE) == 0


async def test_queue_and_task_id_that_join_to_the_same_text_are_two_tasks(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    forget_keys: list[tuple[str, str]],
) -> None:
    # ("Q:x", "y") and ("Q", "x:y") both read "Q:x:y" when joined with a colon.
    app = make_app(max_retries=0)
    ran: list[tuple[str, str]] = []

    @app.handler(f"{qname}:x")
    async def colon_queue(task: Step, ctx: Context) -> str:
        ran.append((ctx.queue, ctx.task_id))
        return "colon-queue"

    @app.handler(qname)
    async def plain_queue(task: Step, ctx: Context) -> str:
        ran.append((ctx.queue, ctx.task_id))
        return "plain-queue"

    forget_keys += [(f"{qname}:x", "y"), (qname, "x:y")]
    await start_worker(app)
    await app.publish(f"{qname}:x", Step(), task_id="y")
    first = await app.result("y", queue=f"{qname}:x", timeout_s=10)
    await app.publish(qname, Step(), task_id="x:y")
    second = await app.result("x:y", queue=qname, timeout_s=10)

    assert sorted(ran) == sorted([(f"{qname}:x", "y"), (qname, "x:y")])
    assert (first.result, second.result) == ("colon-queue", "plain-queue")
    assert outcome_count(app, qname, Outcome.DUPLICATE) == 0


async def test_status_without_a_queue_answers_the_most_recently_written_record(
    redis_client: aioredis.Redis, qname: str, forget_keys: list[tuple[str, str]]
) -> None:
    store = RedisTaskStore(redis_client, ttl_s=60, lease_s=30, done_ttl_s=60)
    task_id, a, b = f"latest-{qname}", f"{qname}-a", f"{qname}-b"
    forget_keys += [(a, task_id), (b, task_id)]

    assert await store.record(TaskState(task_id=task_id, queue=a, status=TaskStatus.RUNNING))
    assert await store.record(
        TaskState(task_id=task_id, queue=b, status=TaskStatus.QUEUED), only_if_new=True
    )
    latest = await store.get(task_id)
    assert latest is not None and (latest.queue, latest.status) == (b, TaskStatus.QUEUED)

    assert await store.record(TaskState(task_id=task_id, queue=a, status=TaskStatus.SUCCEEDED))
    latest = await store.get(task_id)
    assert latest is not None and (latest.queue, latest.status) == (a, TaskStatus.SUCCEEDED)
    # A refused write (a late "queued" for a record that moved on) moves nothing.
    assert not await store.record(
        TaskState(task_id=task_id, queue=a, status=TaskStatus.QUEUED), only_if_new=True
    )
    after = await store.get(task_id, queue=a)
    assert after is not None and after.status is TaskStatus.SUCCEEDED
    latest = await store.get(task_id)
    assert latest is not None and latest.queue == a

    # Forgetting a refused publish's "queued" record drops the pointer to it too.
    await store.forget_queued(b, task_id)
    assert await store.get(task_id, queue=b) is None
    latest = await store.get(task_id)
    assert latest is not None and latest.queue == a


# -- Redis not there ------------------------------------------------------------------------


async def test_status_and_result_raise_state_unavailable_when_redis_refuses_connections(
    broker_url: str,
) -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    async with App("t", settings=settings_for(broker_url, url, redis_timeout_s=2)) as app:
        with pytest.raises(StateUnavailableError, match="Redis"):
            await app.status("some-task")
        with pytest.raises(StateUnavailableError):
            await app.status("some-task", queue="some-queue")
        with pytest.raises(StateUnavailableError):
            await app.result("some-task", timeout_s=1)


async def test_status_and_result_raise_state_unavailable_when_redis_never_answers(
    broker_url: str,
) -> None:
    async with silent_server() as port:
        url = f"redis://127.0.0.1:{port}/0"
        async with App("t", settings=settings_for(broker_url, url, redis_timeout_s=0.5)) as app:
            with pytest.raises(StateUnavailableError):
                await asyncio.wait_for(app.status("some-task"), 10)
            with pytest.raises(StateUnavailableError):
                await asyncio.wait_for(app.result("some-task", queue="q", timeout_s=5), 10)


@pytest.mark.on_private_redis
class TestResultWaitersAcrossARedisRestart:
    """A result() waiter cut off by a Redis restart gives its pub/sub connection back to the
    pool; before, each such waiter leaked one, until the pool was exhausted. The Redis is
    this test's own (``private_redis``)."""

    async def test_a_waiter_cut_off_by_a_redis_restart_returns_its_connection(
        self, make_app: Callable[..., App], private_redis: PrivateRedis, qname: str
    ) -> None:
        app = make_app()
        store = app.results
        assert isinstance(store, RedisTaskStore)
        pool = store._redis.connection_pool
        waiters = [
            asyncio.create_task(app.result(f"{qname}-never-{n}", queue=qname, timeout_s=60))
            for n in range(3)
        ]
        # The three share the store's one subscription (state.redis_wakeups), not one each.
        await wait_until(lambda: len(pool._in_use_connections) >= 1, 10, "the subscription")

        private_redis.stop()
        for waiter in waiters:
            with pytest.raises(StateUnavailableError):
                await asyncio.wait_for(waiter, 30)
        private_redis.start()

        # At most the shared subscription, subscribing again: no waiter kept a connection.
        assert len(pool._in_use_connections) <= 1, "a waiter kept its pub/sub connection"
        assert await app.status(f"{qname}-never-0", queue=qname) is None  # the store works again

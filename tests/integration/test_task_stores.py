"""The worker and App talk to the TaskStore protocol only: the integration suite's core cases
run against the Redis store and the in-memory one (not a subclass of it), on the real broker.

A store-specific path that the worker took for one implementation only would show here as a
case that passes on one store and fails on the other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel

from tests.conftest import (
    SHORT_TTLS,
    close_apps,
    forget_task_keys,
    next_message,
    outcome_count,
    queue_depth,
    settings_for,
    wait_until,
)
from weclaw_mq import (
    App,
    CancelOutcome,
    ConfigurationError,
    Context,
    IdempotencyConflictError,
    Limit,
    MemoryTaskStore,
    RetryPolicy,
    TaskStatus,
)
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name, limit_keys
from weclaw_mq.observability.metrics import Outcome
from weclaw_mq.state import TaskState, TaskStore, open_store
from weclaw_mq.state.redis_clients import StateClient, open_client

FAST_RETRY = RetryPolicy(max_retries=3, delay_s=0.2)


class Job(BaseModel):
    n: int = 0


@dataclass(frozen=True)
class Backing:
    """What a case runs on: its task store, and the Redis its apps use for the rest (limits)."""

    kind: str  # "redis", "redis-cluster" or "memory"
    redis_url: str


@pytest.fixture(params=["redis", "redis-cluster", "memory"])
def backing(request: pytest.FixtureRequest, redis_url: str) -> Backing:
    """Each case runs once per implementation, and the Redis store once more on a Redis
    Cluster of the session's own (three primaries: a test's tasks land on all of them), which
    then serves everything the case's apps keep in Redis."""
    if request.param == "redis-cluster":
        return Backing(request.param, request.getfixturevalue("redis_cluster").url)
    return Backing(request.param, redis_url)


@pytest.fixture
async def store(backing: Backing) -> AsyncIterator[TaskStore]:
    settings = settings_for("amqp://unused", backing.redis_url, **SHORT_TTLS)
    chosen: TaskStore
    if backing.kind != "memory":
        chosen = open_store(settings)
    else:
        chosen = MemoryTaskStore(
            ttl_s=settings.result_ttl_s,
            lease_s=settings.guard_lease_s,
            done_ttl_s=settings.done_ttl_s,
        )
    try:
        yield chosen
    finally:
        await chosen.close()


@pytest.fixture
async def counting(backing: Backing) -> AsyncIterator[StateClient]:
    """A client of the Redis the case's apps keep their limits in (a cluster client there)."""
    client = open_client(settings_for("amqp://unused", backing.redis_url))
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def app_on(
    store: TaskStore, backing: Backing, broker_url: str, redis_url: str
) -> AsyncIterator[Callable[..., App]]:
    """Apps on ``store`` and the test broker; closed, and their queues deleted, at teardown."""
    apps: list[App] = []

    def factory(name: str = "test", **overrides: Any) -> App:
        settings = settings_for(broker_url, backing.redis_url, **{**SHORT_TTLS, **overrides})
        app = App(name, settings=settings, store=store)
        apps.append(app)
        return app

    yield factory
    await close_apps(apps, broker_url, redis_url)


async def test_a_published_task_is_run_and_its_result_read_back(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()

    @app.handler(qname)
    async def double(task: Job) -> dict[str, int]:
        return {"n": task.n * 2}

    await app.declare()
    task_id = await app.publish(qname, Job(n=21))
    queued = await app.status(task_id)
    assert queued is not None and queued.status is TaskStatus.QUEUED
    await start_worker(app)
    state = await app.result(task_id, timeout_s=10)
    assert (state.status, state.result, state.queue) == (TaskStatus.SUCCEEDED, {"n": 42}, qname)
    assert await app.status(task_id, queue=qname) == state
    ids = await app.publish_many(qname, [Job(n=1), Job(n=2)])
    results = [await app.result(t, timeout_s=10) for t in ids]
    assert [r.result for r in results] == [{"n": 2}, {"n": 4}]
    # The result is stored before the ack (by design), so the last ack may come just after.
    await wait_until(lambda: outcome_count(app, qname, Outcome.ACKED) == 3, 5, "three acks")


async def test_a_failing_task_is_recorded_retrying_then_running_then_succeeded(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()
    # The task waits this long in the delay queue: the test sees "retrying" meanwhile.
    retry = RetryPolicy(max_retries=2, delay_s=2.0)
    seen_while_running: list[TaskState | None] = []

    @app.handler(qname, retry=retry)
    async def flaky(task: Job, ctx: Context) -> str:
        seen_while_running.append(await app.status(ctx.task_id, queue=qname))
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return f"ok on {ctx.attempt}"

    await start_worker(app)
    task_id = await app.publish(qname, Job())

    async def retrying() -> bool:
        state = await app.status(task_id, queue=qname)
        return state is not None and state.status is TaskStatus.RETRYING

    await wait_until(retrying, 10, "the record to say retrying")
    state = await app.status(task_id, queue=qname)
    assert state is not None and state.attempt == 1 and "first attempt fails" in (state.error or "")

    final = await app.result(task_id, queue=qname, timeout_s=15)
    assert (final.status, final.result, final.attempt) == (TaskStatus.SUCCEEDED, "ok on 2", 2)
    # The claim wrote "running" for each attempt before the handler ran.
    assert [(s.status, s.attempt) if s else None for s in seen_while_running] == [
        (TaskStatus.RUNNING, 1),
        (TaskStatus.RUNNING, 2),
    ]
    assert outcome_count(app, qname, Outcome.RETRIED) == 1


async def test_exhausted_retries_end_dead_lettered_with_the_reason(
    app_on: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: Any,
) -> None:
    app = app_on()

    @app.handler(qname, retry=RetryPolicy(max_retries=1, delay_s=0.1))
    async def hopeless(task: Job) -> None:
        raise ValueError("never works")

    await start_worker(app)
    task_id = await app.publish(qname, Job())
    state = await app.result(task_id, timeout_s=15)
    assert (state.status, state.reason, state.attempt) == (
        TaskStatus.DEAD_LETTERED,
        "retries_exhausted",
        2,
    )
    assert "never works" in (state.error or "")
    dead = await next_message(amqp, dlq_name(qname))
    assert dead.message_id == task_id
    assert (dead.headers or {}).get(h.DEAD_LETTER_REASON) == "retries_exhausted"


async def test_a_copy_of_a_finished_task_is_acked_without_running(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()
    runs: list[str] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def once(task: Job, ctx: Context) -> str:
        runs.append(ctx.task_id)
        return uuid.uuid4().hex  # a second run would return another value

    await start_worker(app)
    task_id = await app.publish(qname, Job())
    first = await app.result(task_id, timeout_s=10)
    await app.publish(qname, Job(), task_id=task_id)

    await wait_until(
        lambda: outcome_count(app, qname, Outcome.DUPLICATE) == 1, 10, "the copy to be acked"
    )
    assert runs == [task_id]
    again = await app.status(task_id, queue=qname)
    assert again is not None and again.result == first.result


async def test_a_copy_arriving_while_its_twin_runs_is_deferred_then_acked_unrun(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()
    runs: list[str] = []
    release = asyncio.Event()

    @app.handler(qname, retry=FAST_RETRY)
    async def slow(task: Job, ctx: Context) -> int:
        runs.append(ctx.task_id)
        await release.wait()
        return task.n

    await start_worker(app, concurrency=2)
    task_id = await app.publish(qname, Job(n=7))
    await wait_until(lambda: runs == [task_id], 10, "the first copy to run")
    await app.publish(qname, Job(n=7), task_id=task_id)
    await wait_until(
        lambda: outcome_count(app, qname, Outcome.DEFERRED) >= 1, 10, "the twin to be deferred"
    )
    release.set()
    state = await app.result(task_id, timeout_s=10)
    assert state.result == 7
    await wait_until(
        lambda: outcome_count(app, qname, Outcome.DUPLICATE) == 1,
        10,
        "the deferred copy to come back and be acked unrun",
    )
    assert runs == [task_id]


async def test_pipeline_stages_sharing_a_task_id_keep_a_record_and_a_claim_each(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    first, second = f"{qname}-one", f"{qname}-two"
    app = app_on(max_retries=0)
    runs: list[str] = []

    @app.handler(first)
    async def stage_one(task: Job, ctx: Context) -> dict[str, int]:
        runs.append(ctx.queue)
        await ctx.publish(second, Job(n=task.n + 1), task_id=ctx.task_id)
        return {"stage": 1}

    @app.handler(second)
    async def stage_two(task: Job, ctx: Context) -> dict[str, int]:
        runs.append(ctx.queue)
        return {"stage": 2, "n": task.n}

    await app.declare()
    # Stage 2 runs only once stage 1's record is final: then "latest" is stage 2 for sure.
    await start_worker(app, queues=[first])
    task_id = await app.publish(first, Job(n=1))
    one = await app.result(task_id, queue=first, timeout_s=10)
    assert one.result == {"stage": 1}
    await start_worker(app, queues=[second])
    two = await app.result(task_id, queue=second, timeout_s=10)
    assert two.result == {"stage": 2, "n": 2}

    # Without a queue: the most recently written record, here stage 2's.
    latest = await app.status(task_id)
    assert latest is not None and (latest.queue, latest.result) == (second, two.result)
    kept = await app.status(task_id, queue=first)
    assert kept is not None and kept.result == {"stage": 1}
    assert runs == [first, second]
    assert outcome_count(app, second, Outcome.DUPLICATE) == 0


async def test_status_across_queues_follows_the_rules_of_the_records(
    store: TaskStore, qname: str, redis_url: str
) -> None:
    task_id, a, b = f"latest-{qname}", f"{qname}-a", f"{qname}-b"

    def state(queue: str, status: TaskStatus) -> TaskState:
        return TaskState(task_id=task_id, queue=queue, status=status)

    assert await store.record(state(a, TaskStatus.RUNNING))
    assert await store.record(state(b, TaskStatus.QUEUED), only_if_new=True)
    latest = await store.get(task_id)
    assert latest is not None and (latest.queue, latest.status) == (b, TaskStatus.QUEUED)

    assert await store.record(state(a, TaskStatus.SUCCEEDED))
    latest = await store.get(task_id)
    assert latest is not None and (latest.queue, latest.status) == (a, TaskStatus.SUCCEEDED)
    # Refused writes (a late "queued"; anything over succeeded) move nothing.
    assert not await store.record(state(a, TaskStatus.QUEUED), only_if_new=True)
    assert not await store.record(state(a, TaskStatus.RETRYING))
    after = await store.get(task_id, queue=a)
    assert after is not None and after.status is TaskStatus.SUCCEEDED

    # Forgetting a refused publish's "queued" record drops the pointer to it too.
    assert await store.record(state(b, TaskStatus.QUEUED))
    await store.forget_queued(b, task_id)
    assert await store.get(task_id, queue=b) is None
    assert await store.get(task_id) is None
    await forget_task_keys(redis_url, [a, b])  # nothing there for the in-memory store


async def test_with_results_off_the_guard_still_claims_and_marks_done(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on(results_enabled=False)
    runs: list[str] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def once(task: Job, ctx: Context) -> None:
        runs.append(ctx.task_id)

    await start_worker(app)
    task_id = await app.publish(qname, Job())
    await wait_until(lambda: runs == [task_id], 10, "the task to run")
    await wait_until(lambda: outcome_count(app, qname, Outcome.ACKED) == 1, 10, "its ack")
    await app.publish(qname, Job(), task_id=task_id)
    await wait_until(
        lambda: outcome_count(app, qname, Outcome.DUPLICATE) == 1, 10, "the copy to be acked"
    )
    assert runs == [task_id]
    with pytest.raises(ConfigurationError):
        await app.status(task_id)


async def test_a_queued_task_cancelled_before_any_worker_runs_is_acked_unrun(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()
    ran: list[int] = []

    @app.handler(qname)
    async def handle(task: Job) -> int:
        ran.append(task.n)
        return task.n

    await app.declare()
    doomed = await app.publish(qname, Job(n=1))
    answer = await app.cancel(doomed)
    assert answer.outcome is CancelOutcome.CANCELLED and answer.changed
    other = await app.publish(qname, Job(n=2))
    await start_worker(app, concurrency=1)
    assert (await app.result(other, timeout_s=10)).result == 2
    await wait_until(
        lambda: outcome_count(app, qname, Outcome.CANCELLED) == 1, 10, "the cancel acked"
    )
    assert ran == [2]
    final = await app.result(doomed, timeout_s=1)
    assert final.status is TaskStatus.CANCELLED and final.result is None


async def test_a_running_task_cancelled_is_stopped_and_acked_as_cancelled(
    app_on: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = app_on()
    started = asyncio.Event()
    stopped: list[bool] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def generate(task: Job, ctx: Context) -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.append(ctx.cancelled)
            raise
        return "the whole answer"

    await start_worker(app)
    task_id = await app.publish(qname, Job())
    await asyncio.wait_for(started.wait(), 10)
    # The request reaches the worker through the store's subscription (on a cluster: a
    # PUBLISH on the task's node, heard on the node the worker subscribed on).
    assert (await app.cancel(task_id)).outcome is CancelOutcome.CANCELLED
    await wait_until(
        lambda: outcome_count(app, qname, Outcome.CANCELLED) == 1, 10, "the cancel acked"
    )
    assert stopped == [True]
    assert outcome_count(app, qname, Outcome.RETRIED) == 0
    final = await app.result(task_id, queue=qname, timeout_s=1)
    assert final.status is TaskStatus.CANCELLED


async def test_a_per_key_concurrency_limit_holds_its_key_and_lets_other_keys_run(
    app_on: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    backing: Backing,
    counting: StateClient,
) -> None:
    app = app_on()
    release = asyncio.Event()
    running: Counter[str] = Counter()
    most: Counter[str] = Counter()

    def key_of(job: Job) -> str:
        return "hot" if job.n < 3 else f"k{job.n}"

    @app.handler(qname, retry=FAST_RETRY, limit=Limit(key=key_of, concurrency=1))
    async def work(task: Job) -> int:
        key = key_of(task)
        running[key] += 1
        most[key] = max(most[key], running[key])
        try:
            if key == "hot":
                await release.wait()
        finally:
            running[key] -= 1
        return task.n

    await start_worker(app, concurrency=8)
    ids = await app.publish_many(qname, [Job(n=n) for n in range(6)])
    # The other keys run while the hot key's first task holds its only slot...
    for task_id in ids[3:]:
        assert (await app.result(task_id, timeout_s=10)).status is TaskStatus.SUCCEEDED

    def deferrals() -> float:
        value = app.metrics.registry.get_sample_value(
            "weclaw_mq_limit_deferrals_total", {"queue": qname, "limit": "concurrency"}
        )
        return value or 0.0

    # ...and its two others are refused (deferred), not run beside it.
    await wait_until(lambda: deferrals() >= 2, 10, "the hot key's others to be refused")
    assert running["hot"] == 1
    # The slot is counted in the case's Redis (on a cluster: on the node of the key's tag).
    hot_slots, _ = limit_keys(qname, 0, "hot")
    assert await counting.zcard(hot_slots) == 1
    release.set()
    for task_id in ids[:3]:
        assert (await app.result(task_id, timeout_s=15)).status is TaskStatus.SUCCEEDED
    assert most == Counter({"hot": 1, "k3": 1, "k4": 1, "k5": 1})
    assert outcome_count(app, qname, Outcome.RETRIED) == 0

    async def released() -> bool:
        return await counting.zcard(hot_slots) == 0

    await wait_until(released, 5, "the hot key's slot to be released")


async def test_a_task_id_published_again_with_another_body_is_refused(
    app_on: Callable[..., App], qname: str, amqp: Any
) -> None:
    app = app_on()

    @app.handler(qname)
    async def handle(task: Job) -> None: ...

    await app.declare()
    key = f"order-{qname}"
    assert await app.publish(qname, Job(n=1), task_id=key, refuse_other_body=True) == key
    with pytest.raises(IdempotencyConflictError) as refused:
        await app.publish(qname, Job(n=2), task_id=key, refuse_other_body=True)
    assert (refused.value.task_id, refused.value.queue) == (key, qname)
    # The same body again is the same task: it goes out (a duplicate the guard acks unrun).
    assert await app.publish(qname, Job(n=1), task_id=key, refuse_other_body=True) == key
    assert await queue_depth(amqp, qname) == 2

"""Effects once per task id: the idempotency guard and the result store, on real RabbitMQ + Redis.

Delivery is at-least-once; these tests make duplicates happen for real (the same task id
published twice, two workers racing, a worker killed between storing the result and acking,
Redis stopped under a consuming worker) and count how often the handler actually ran.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from tests.conftest import (
    SHORT_TTLS,
    delete_queues,
    forget_task_keys,
    outcome_count,
    settings_for,
    wait_until,
)
from tests.integration.fixture_apps import guard_app
from tests.integration.processes import (
    WorkerProcess,
    all_empty,
    queue_names,
    ready_count,
    ready_count_is,
    run_cli,
)
from tests.private_servers import PrivateRedis
from weclaw_mq import App, Context, ResultTimeoutError, RetryPolicy, TaskStatus
from weclaw_mq.contract.naming import guard_key, task_keys
from weclaw_mq.observability.metrics import Outcome

FAST_RETRY = RetryPolicy(max_retries=3, delay_s=0.2)


class Job(BaseModel):
    n: int = 0
    sleep_s: float = 0.0


def settled(apps: list[App], queue: str) -> float:
    """Deliveries that ended in an ack of the task itself: ran and acked, or acked unrun."""
    return sum(
        outcome_count(app, queue, Outcome.ACKED) + outcome_count(app, queue, Outcome.DUPLICATE)
        for app in apps
    )


# -- the guard ----------------------------------------------------------------------------


async def test_two_workers_given_the_same_task_id_at_once_run_the_handler_once(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, broker_url: str
) -> None:
    runs: list[str] = []
    apps = [make_app(f"twin-{i}", **SHORT_TTLS) for i in range(2)]
    for app in apps:

        @app.handler(qname, retry=FAST_RETRY)
        async def slow(task: Job, ctx: Context) -> dict[str, int]:
            runs.append(ctx.task_id)
            await asyncio.sleep(0.5)
            return {"n": task.n}

    # Prefetch 1 each: while one worker holds the first copy, the broker must hand the
    # second copy to the other worker, so both run the guard at the same time.
    for app in apps:
        await start_worker(app, concurrency=1)
    task_id = str(uuid.uuid4())
    await apps[0].publish(qname, Job(n=1), task_id=task_id)
    await apps[0].publish(qname, Job(n=1), task_id=task_id)

    await wait_until(lambda: settled(apps, qname) >= 2, 15, "both copies to be acked")
    assert runs == [task_id]
    assert sum(outcome_count(a, qname, Outcome.DEFERRED) for a in apps) >= 1, (
        "the second copy never met the first one running: the race was not exercised"
    )
    assert sum(outcome_count(a, qname, Outcome.DUPLICATE) for a in apps) == 1
    state = await apps[0].result(task_id, timeout_s=5)
    assert (state.status, state.result) == (TaskStatus.SUCCEEDED, {"n": 1})
    names = [qname]  # (the delay queues are the vhost's, shared with other tests)
    await wait_until(lambda: all_empty(broker_url, names), 5, "the queues to be empty")


async def test_same_task_id_published_twice_runs_once_and_has_one_result(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, broker_url: str
) -> None:
    app = make_app(**SHORT_TTLS)
    tokens: list[str] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def once(task: Job) -> dict[str, str]:
        # A value only this run can return: a second run would change or contradict it.
        token = uuid.uuid4().hex
        tokens.append(token)
        return {"token": token}

    await start_worker(app, concurrency=1)
    task_id = await app.publish(qname, Job(n=2))
    assert await app.publish(qname, Job(n=2), task_id=task_id) == task_id

    await wait_until(lambda: settled([app], qname) >= 2, 15, "both copies to be acked")
    assert len(tokens) == 1
    assert outcome_count(app, qname, Outcome.DUPLICATE) == 1
    first = await app.result(task_id, timeout_s=5)
    again = await app.result(task_id, timeout_s=5)
    assert first.status is TaskStatus.SUCCEEDED
    assert first.result == again.result == {"token": tokens[0]}
    await wait_until(lambda: all_empty(broker_url, queue_names(app)), 5, "the queues to be empty")


async def test_handler_longer_than_the_initial_lease_is_not_run_twice_by_a_duplicate(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    redis_client: aioredis.Redis,
) -> None:
    lease_s = 0.6
    app = make_app(guard_lease_s=lease_s, **SHORT_TTLS)
    starts: list[str] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def long_call(task: Job, ctx: Context) -> dict[str, int]:
        starts.append(ctx.task_id)
        await asyncio.sleep(2.0)
        return {"n": task.n}

    await start_worker(app, concurrency=2)
    task_id = await app.publish(qname, Job(n=3))
    await wait_until(lambda: starts, 10, "the first copy to start")
    await app.publish(qname, Job(n=3), task_id=task_id)

    await wait_until(lambda: settled([app], qname) >= 2, 15, "both copies to be acked")
    assert starts == [task_id]
    # Each round trip through the delay queue takes at least its TTL (0.2 s), so four
    # refusals mean the copy was still turned away after the initial 0.6 s lease had run
    # out: only a renewed lease can do that.
    deferred = outcome_count(app, qname, Outcome.DEFERRED)
    assert deferred * FAST_RETRY.delay_s > lease_s, f"deferred only {deferred} times"
    assert await redis_client.get(guard_key(qname, task_id)) == b"done"
    state = await app.result(task_id, timeout_s=5)
    assert (state.status, state.result) == (TaskStatus.SUCCEEDED, {"n": 3})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scrape_outcomes(port: int, queue: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "weclaw_mq_messages_total" and sample.labels["queue"] == queue:
                found[sample.labels["outcome"]] = sample.value
    return found


async def test_worker_killed_after_storing_the_result_but_before_the_ack_does_not_rerun_it(
    qname: str, broker_url: str, redis_url: str, redis_client: aioredis.Redis, tmp_path: Path
) -> None:
    # A short lease, so that a library which re-runs the task once the dead worker's claim
    # lapses shows it within this test rather than 30 s later.
    settings = settings_for(
        broker_url, redis_url, guard_lease_s=1.0, retry_delay_s=0.2, **SHORT_TTLS
    )
    record_key = f"weclaw-test:{qname}"
    runs = guard_app.runs_key(record_key)
    publisher = guard_app.build_app(qname, settings=settings, record_key=record_key)
    workers: list[WorkerProcess] = []
    task_id = ""
    try:
        await publisher.declare()

        def spawn(name: str, **kwargs: Any) -> WorkerProcess:
            worker = guard_app.spawn_worker(
                queue=qname,
                record_key=record_key,
                settings=settings,
                log_path=tmp_path / f"{name}.log",
                **kwargs,
            )
            workers.append(worker)
            return worker

        first = spawn("first", die_after_store=True)
        await first.wait_consuming()
        task_id = await publisher.publish(qname, guard_app.Job(n=7, die_after_store=True))
        assert await first.wait_exit(20) == -signal.SIGKILL, first.describe()
        # The moment of the kill: handler done, result stored, not acked.
        assert await redis_client.lrange(runs, 0, -1) == [task_id.encode()]
        stored = await publisher.status(task_id)
        assert stored is not None and stored.status is TaskStatus.SUCCEEDED

        port = _free_port()
        second = spawn("second", metrics_port=port)
        await second.wait_consuming()

        async def redelivery_settled() -> bool:
            found = await asyncio.to_thread(_scrape_outcomes, port, qname)
            return found.get(Outcome.ACKED.value, 0) + found.get(Outcome.DUPLICATE.value, 0) >= 1

        await wait_until(redelivery_settled, 20, "the redelivered copy to be acked")
        second.signal(signal.SIGTERM)
        assert await second.wait_exit(20) == 0, second.describe()

        completions = [guard_app.as_text(r) for r in await redis_client.lrange(runs, 0, -1)]
        assert completions == [task_id], (
            f"the handler ran {len(completions)} times for one task: the redelivered copy "
            "ran again although its result was already stored"
        )
        state = await publisher.status(task_id)
        assert state is not None and state.status is TaskStatus.SUCCEEDED
        assert state.result == {"n": 7, "pid": first.pid}
        for name in queue_names(publisher):
            assert await ready_count(broker_url, name) == 0, f"{name} is not empty"
    finally:
        for worker in workers:
            worker.kill()
        await publisher.close()
        await delete_queues(broker_url, queue_names(publisher))
        await forget_task_keys(redis_url, [qname])
        keys = guard_app.record_keys(record_key)
        if task_id:
            keys += task_keys(qname, task_id)
        await redis_client.delete(*keys)


# -- Redis going away under a consuming worker ----------------------------------------------


@pytest.mark.on_private_redis
class TestRedisGoingAway:
    """Redis stopped under a consuming worker and started again: a redis-server of each
    test's own (``private_redis``), never the shared one, which other runs are using."""

    async def test_tasks_published_while_redis_is_down_are_deferred_then_run_once_when_it_returns(
        self,
        make_app: Callable[..., App],
        start_worker: Callable[..., Any],
        qname: str,
        broker_url: str,
        private_redis: PrivateRedis,
    ) -> None:
        app = make_app(result_store_patience_s=30, **SHORT_TTLS)
        # Counted in this process: Redis is exactly what is missing during the test.
        runs: Counter[str] = Counter()
        started: set[str] = set()

        @app.handler(qname, retry=FAST_RETRY)
        async def work(task: Job, ctx: Context) -> dict[str, int]:
            started.add(ctx.task_id)
            await asyncio.sleep(task.sleep_s)
            runs[ctx.task_id] += 1
            return {"n": task.n}

        await start_worker(app, concurrency=4)
        warm = await app.publish(qname, Job(n=0))
        assert (await app.result(warm, timeout_s=10)).status is TaskStatus.SUCCEEDED
        # One task is mid-handler when Redis goes: it must keep its result until Redis is back.
        in_flight = await app.publish(qname, Job(n=-1, sleep_s=1.0))
        await wait_until(lambda: in_flight in started, 10, "the in-flight task to start")

        await asyncio.to_thread(private_redis.stop)
        t0 = time.perf_counter()
        down_ids = [await app.publish(qname, Job(n=i)) for i in range(1, 11)]
        publish_s = time.perf_counter() - t0
        # Every task met the missing Redis at least once and was parked, not run.
        await wait_until(
            lambda: outcome_count(app, qname, Outcome.DEFERRED) >= len(down_ids),
            15,
            "every task to be deferred while Redis is down",
        )
        assert not started & set(down_ids), "a task ran without its guard while Redis was down"
        # The handler itself needs no Redis: the in-flight task finishes and holds its result.
        await wait_until(lambda: runs[in_flight] == 1, 10, "the in-flight handler to return")
        assert settled([app], qname) == 1, "a task was acked while its result could not be stored"

        restart_s = await asyncio.to_thread(private_redis.start)
        t1 = time.perf_counter()
        states = await asyncio.gather(
            *(app.result(t, timeout_s=30) for t in [*down_ids, in_flight])
        )
        resume_s = time.perf_counter() - t1
        print(
            f"\nRedis down: 10 publishes {publish_s:.2f} s, Redis restart {restart_s:.2f} s, "
            f"all results {resume_s:.2f} s after the restart"
        )
        assert [s.status for s in states] == [TaskStatus.SUCCEEDED] * len(states)
        assert [s.result for s in states] == [{"n": i} for i in range(1, 11)] + [{"n": -1}]
        assert {t: runs[t] for t in [warm, in_flight, *down_ids]} == dict.fromkeys(
            [warm, in_flight, *down_ids], 1
        )
        await wait_until(
            lambda: settled([app], qname) >= 12, 10, "every task to be acked after Redis returned"
        )
        await wait_until(
            lambda: all_empty(broker_url, queue_names(app)), 5, "the queues to be empty"
        )

    async def test_run_unguarded_mode_runs_tasks_while_redis_is_down(
        self,
        make_app: Callable[..., App],
        start_worker: Callable[..., Any],
        qname: str,
        broker_url: str,
        private_redis: PrivateRedis,
    ) -> None:
        app = make_app(
            guard_on_redis_down="run_unguarded", result_store_patience_s=30, **SHORT_TTLS
        )
        runs: Counter[str] = Counter()

        @app.handler(qname, retry=FAST_RETRY)
        async def work(task: Job, ctx: Context) -> dict[str, int]:
            runs[ctx.task_id] += 1
            return {"n": task.n}

        # Each task that ran holds its slot until its result is stored, i.e. until Redis is
        # back: more tasks than slots would stall the worker (see result_store_patience_s).
        await start_worker(app, concurrency=8)
        await asyncio.to_thread(private_redis.stop)
        ids = [await app.publish(qname, Job(n=i)) for i in range(5)]
        await wait_until(lambda: set(runs) == set(ids), 15, "every task to run with Redis down")
        # Their results wait for Redis (result_store_patience_s) instead of being acked unstored.
        assert settled([app], qname) == 0

        await asyncio.to_thread(private_redis.start)
        states = await asyncio.gather(*(app.result(t, timeout_s=30) for t in ids))
        assert [s.status for s in states] == [TaskStatus.SUCCEEDED] * len(ids)
        assert [runs[t] for t in ids] == [1] * len(ids)
        await wait_until(lambda: settled([app], qname) >= len(ids), 10, "every task to be acked")
        await wait_until(
            lambda: all_empty(broker_url, queue_names(app)), 5, "the queues to be empty"
        )


# -- the result store ---------------------------------------------------------------------


async def test_status_is_queued_after_publish_and_succeeded_with_the_handler_value_after_it_ran(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(**SHORT_TTLS)

    @app.handler(qname, retry=FAST_RETRY)
    async def double(task: Job) -> dict[str, int]:
        return {"double": task.n * 2}

    await app.declare()
    task_id = await app.publish(qname, Job(n=21))
    queued = await app.status(task_id)
    assert queued is not None
    assert (queued.status, queued.queue, queued.result) == (TaskStatus.QUEUED, qname, None)

    await start_worker(app)
    state = await app.result(task_id, timeout_s=10)
    assert (state.status, state.result, state.attempt) == (
        TaskStatus.SUCCEEDED,
        {"double": 42},
        1,
    )
    assert await app.status(task_id) == state


async def test_handler_that_exhausts_its_retries_ends_dead_lettered_with_reason_and_error(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(**SHORT_TTLS)

    @app.handler(qname, retry=RetryPolicy(max_retries=2, delay_s=0.05))
    async def overloaded(task: Job) -> None:
        raise RuntimeError(f"model overloaded for job {task.n}")

    await start_worker(app)
    task_id = await app.publish(qname, Job(n=5))
    state = await app.result(task_id, timeout_s=10)
    assert state.status is TaskStatus.DEAD_LETTERED
    assert state.reason == "retries_exhausted"
    assert state.error == "RuntimeError: model overloaded for job 5"
    assert state.attempt == 3


async def test_handler_returning_a_value_that_is_not_json_ends_dead_lettered_as_invalid_result(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str, broker_url: str
) -> None:
    app = make_app(**SHORT_TTLS)
    calls: list[str] = []

    @app.handler(qname, retry=FAST_RETRY)
    async def opaque(task: Job, ctx: Context) -> object:
        calls.append(ctx.task_id)
        return object()

    await start_worker(app)
    task_id = await app.publish(qname, Job(n=6))
    state = await app.result(task_id, timeout_s=10)
    assert (state.status, state.reason) == (TaskStatus.DEAD_LETTERED, "invalid_result")
    assert state.error is not None and "not JSON" in state.error
    # Retrying cannot make the value serialisable: one call, straight to the DLQ.
    assert calls == [task_id]
    await wait_until(
        lambda: ready_count_is(broker_url, f"{qname}.dlq", 1), 5, "the task to reach the DLQ"
    )


async def test_result_raises_result_timeout_error_when_nothing_finishes_in_time(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app(**SHORT_TTLS)

    @app.handler(qname, retry=FAST_RETRY)
    async def never_consumed(task: Job) -> None:
        return None

    await app.declare()
    task_id = await app.publish(qname, Job())
    t0 = time.perf_counter()
    with pytest.raises(ResultTimeoutError) as caught:
        await app.result(task_id, timeout_s=0.3)
    assert time.perf_counter() - t0 < 2.0
    assert caught.value.task_id == task_id
    assert getattr(caught.value.last, "status", None) is TaskStatus.QUEUED


async def test_cli_status_prints_the_state_as_json_and_exits_1_for_an_unknown_task(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    broker_url: str,
    redis_url: str,
) -> None:
    app = make_app(**SHORT_TTLS)

    @app.handler(qname, retry=FAST_RETRY)
    async def echo(task: Job) -> dict[str, int]:
        return {"echo": task.n}

    await start_worker(app)
    task_id = await app.publish(qname, Job(n=9))
    await app.result(task_id, timeout_s=10)
    env = {"WECLAW_MQ_AMQP_URL": broker_url, "WECLAW_MQ_REDIS_URL": redis_url}

    known = await run_cli("status", task_id, env=env)
    assert known.code == 0, known.stderr
    shown = json.loads(known.stdout)
    assert shown["task_id"] == task_id
    assert (shown["status"], shown["result"], shown["queue"]) == ("succeeded", {"echo": 9}, qname)

    unknown_id = str(uuid.uuid4())
    unknown = await run_cli("status", unknown_id, env=env)
    assert unknown.code == 1
    assert unknown_id in unknown.stderr
    assert unknown.stdout == ""

"""The guard's lease on real Redis: a claim holds while its worker lives and its attempt is
not over, and not a moment past either.

- A killed worker's claims lapse with its heartbeat (seconds), not with the lease (30 s).
- A live worker keeps its claims past both, for as long as the handler runs and its result
  is being stored (a result write that retries included).
- The first finish wins: a finish by an attempt that lost its claim is told so, and a later
  finish writes nothing.
- A store reused under a second ``asyncio.run`` renews its leases there too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import delete_queues, forget_task_keys, settings_for, wait_until
from tests.integration.processes import queue_names
from weclaw_mq import App, Context, Settings, Worker
from weclaw_mq.contract.naming import heartbeat_key
from weclaw_mq.state import Claim, Finish, TaskState, TaskStatus, new_owner
from weclaw_mq.state.redis import RedisTaskStore, open_redis_store

HEARTBEAT_S = 1.0
# Waiting on a heartbeat to lapse: its TTL, then the slack of a loaded 2-core machine.
LAPSE_BOUND_S = HEARTBEAT_S + 3.0


class Job(BaseModel):
    n: int = 0


def _settings(redis_url: str, **overrides: Any) -> Settings:
    return settings_for(
        "amqp://unused",
        redis_url,
        result_ttl_s=120,
        done_ttl_s=120,
        guard_heartbeat_ttl_s=HEARTBEAT_S,
        **overrides,
    )


@pytest.fixture
def queue() -> str:
    return f"t-lease-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def rival(redis_url: str, queue: str) -> AsyncIterator[RedisTaskStore]:
    """Another worker's store, on the same Redis; the test's task keys go at teardown."""
    store = open_redis_store(_settings(redis_url))
    try:
        yield store
    finally:
        await store.close()
        await forget_task_keys(redis_url, [queue])


_VICTIM = textwrap.dedent(
    """
    import asyncio, sys
    from weclaw_mq import Settings
    from weclaw_mq.state import Claim
    from weclaw_mq.state.redis import open_redis_store

    async def main(queue: str, task_id: str) -> None:
        store = open_redis_store(Settings())
        assert await store.claim(queue, task_id, "victim") is Claim.ACQUIRED
        with store.holding(queue, task_id, "victim"):
            print(store.worker_id, flush=True)
            await asyncio.sleep(600)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_a_killed_workers_claim_is_free_once_its_heartbeat_lapses_not_after_the_lease(
    redis_url: str, queue: str, rival: RedisTaskStore, redis_client: aioredis.Redis
) -> None:
    task_id = str(uuid.uuid4())
    env = {
        **os.environ,
        "WECLAW_MQ_REDIS_URL": redis_url,
        "WECLAW_MQ_GUARD_HEARTBEAT_TTL_S": str(HEARTBEAT_S),
        "WECLAW_MQ_GUARD_LEASE_S": "30",
    }
    victim = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _VICTIM, queue, task_id, env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert victim.stdout is not None
        line = await asyncio.wait_for(victim.stdout.readline(), 20)
        worker_id = line.decode().strip()
        assert worker_id, f"the victim did not claim (exit {victim.returncode})"
        # Alive, it keeps its claim past its heartbeat's TTL (renewed).
        await asyncio.sleep(2 * HEARTBEAT_S)
        assert await rival.claim(queue, task_id, new_owner()) is Claim.BUSY
        assert await redis_client.exists(heartbeat_key(worker_id))

        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        killed = time.monotonic()
        owner = new_owner()
        running = TaskState(task_id=task_id, queue=queue, status=TaskStatus.RUNNING)

        async def claimed() -> bool:
            return await rival.claim(queue, task_id, owner, running=running) is Claim.ACQUIRED

        # The lease (30 s) has most of its time left: only the lapsed heartbeat frees it.
        await wait_until(claimed, LAPSE_BOUND_S, "the dead worker's claim to lapse")
        print(f"claim taken over {time.monotonic() - killed:.2f} s after the kill -9")
        state = await rival.get(task_id, queue=queue)
        assert state is not None and state.status is TaskStatus.RUNNING
        # Taken over, it is the rival's: another copy is told busy.
        assert await rival.claim(queue, task_id, new_owner()) is Claim.BUSY
        assert await rival.finish(queue, task_id, None, owner=owner) is Finish.FINISHED
    finally:
        if victim.returncode is None:
            victim.kill()
            await victim.wait()


async def test_a_live_holder_keeps_its_claim_past_the_heartbeat_and_the_lease(
    redis_url: str, queue: str, rival: RedisTaskStore
) -> None:
    holder = open_redis_store(_settings(redis_url, guard_lease_s=1.0))
    task_id, owner = str(uuid.uuid4()), new_owner()
    try:
        assert await holder.claim(queue, task_id, owner) is Claim.ACQUIRED
        with holder.holding(queue, task_id, owner):
            await asyncio.sleep(3 * max(HEARTBEAT_S, 1.0))
            assert await rival.claim(queue, task_id, new_owner()) is Claim.BUSY
    finally:
        await holder.close()


async def test_a_finish_by_an_attempt_that_lost_its_claim_stores_first_and_a_later_one_nothing(
    redis_url: str, queue: str, rival: RedisTaskStore
) -> None:
    # The first attempt's lease lapses (its holder renews nothing: no ``holding``); a second
    # attempt claims the task and runs. The first to finish stores its result; the second is
    # told the task is done, and its result is not written over the first.
    first = open_redis_store(_settings(redis_url, guard_lease_s=0.5))
    task_id, early, late = str(uuid.uuid4()), new_owner(), new_owner()

    def state(status: TaskStatus, result: Any = None) -> TaskState:
        return TaskState(task_id=task_id, queue=queue, status=status, result=result)

    try:
        assert await first.claim(queue, task_id, early) is Claim.ACQUIRED

        async def lapsed() -> bool:
            answer = await rival.claim(queue, task_id, late, running=state(TaskStatus.RUNNING))
            return answer is Claim.ACQUIRED

        await wait_until(lapsed, 5, "the first attempt's lease to lapse")
        taken = await first.finish(queue, task_id, state(TaskStatus.SUCCEEDED, 1), owner=early)
        assert taken is Finish.TAKEN
        done = await rival.finish(queue, task_id, state(TaskStatus.SUCCEEDED, 2), owner=late)
        assert done is Finish.DONE
        stored = await rival.get(task_id, queue=queue)
        assert stored is not None and (stored.status, stored.result) == (TaskStatus.SUCCEEDED, 1)
        assert await rival.claim(queue, task_id, new_owner()) is Claim.DONE
    finally:
        await first.close()


def test_a_store_reused_under_a_second_asyncio_run_renews_its_leases_there(
    redis_url: str, queue: str
) -> None:
    # The caller's client, closed at the end of each run (its connections belong to that
    # run's loop); the store itself is used on across both.
    client = aioredis.Redis.from_url(redis_url)
    store = RedisTaskStore(client, ttl_s=120, lease_s=0.6, done_ttl_s=120)
    task_id = str(uuid.uuid4())

    async def first_run() -> None:
        owner = new_owner()
        try:
            assert await store.claim(queue, "warm-up", owner) is Claim.ACQUIRED
            with store.holding(queue, "warm-up", owner):
                await asyncio.sleep(0)  # the renewer started on this loop, which ends now
            await store.release(queue, "warm-up", owner)
        finally:
            await client.aclose()

    async def second_run() -> Claim:
        rival = open_redis_store(_settings(redis_url))
        owner = new_owner()
        try:
            assert await store.claim(queue, task_id, owner) is Claim.ACQUIRED
            with store.holding(queue, task_id, owner):
                await asyncio.sleep(4 * 0.6)  # lapsed by now, unless renewed
                return await rival.claim(queue, task_id, new_owner())
        finally:
            await rival.close()
            await store.close()
            await client.aclose()
            await forget_task_keys(redis_url, [queue])

    asyncio.run(first_run())
    assert asyncio.run(second_run()) is Claim.BUSY, "the lease lapsed: nothing renewed it"


class _SlowToStore(RedisTaskStore):
    """Its finish fails (as if Redis did not answer) until ``stored`` is set."""

    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        super().__init__(
            client,
            ttl_s=settings.result_ttl_s,
            lease_s=settings.guard_lease_s,
            done_ttl_s=settings.done_ttl_s,
            heartbeat_ttl_s=settings.guard_heartbeat_ttl_s,
        )
        self.stored = asyncio.Event()
        self.failed_tries = 0

    async def finish(
        self, queue: str, task_id: str, result: TaskState | None, *, owner: str | None = None
    ) -> Finish:
        if not self.stored.is_set():
            self.failed_tries += 1
            raise ConnectionError("Redis did not answer (the test's)")
        return await super().finish(queue, task_id, result, owner=owner)


async def test_the_lease_is_kept_while_a_finished_tasks_result_is_being_stored(
    broker_url: str,
    redis_url: str,
    queue: str,
    rival: RedisTaskStore,
) -> None:
    lease_s = 1.0
    settings = settings_for(broker_url, redis_url, guard_lease_s=lease_s, result_ttl_s=120)
    client = aioredis.Redis.from_url(redis_url)
    store = _SlowToStore(client, settings)
    app = App("test", settings=settings, store=store)
    runs: list[str] = []

    @app.handler(queue)
    async def work(task: Job, ctx: Context) -> dict[str, int]:
        runs.append(ctx.task_id)
        return {"n": task.n}

    worker = Worker(app, concurrency=1)
    running = asyncio.create_task(worker.run())
    try:
        await wait_until(worker.ready.is_set, 20, "the worker to consume")
        task_id = await app.publish(queue, Job(n=7))
        await wait_until(lambda: store.failed_tries >= 2, 20, "the result write to be retried")
        # Three leases later, the result still not stored: the claim is still held.
        await asyncio.sleep(3 * lease_s)
        assert await rival.claim(queue, task_id, new_owner()) is Claim.BUSY, "the lease lapsed"
        store.stored.set()
        state = await app.result(task_id, timeout_s=20)
        assert (state.status, state.result) == (TaskStatus.SUCCEEDED, {"n": 7})
        assert runs == [task_id]
    finally:
        store.stored.set()  # the worker's stop drains its handler
        # Stopped before its queues go: a running worker would declare them again.
        worker.stop()
        await asyncio.wait_for(running, 30)
        await app.close()
        await store.close()
        await client.aclose()
        await delete_queues(broker_url, queue_names(app))

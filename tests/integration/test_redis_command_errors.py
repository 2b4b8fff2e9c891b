"""A deterministic error from Redis is a bug or a setting to fix, never "Redis is down".

Redis answering a command with an error (a script error, "invalid expire time", WRONGTYPE)
fails the same way on every try: it surfaces as ``StateCommandError``, saying it is not an
outage, and the worker logs it as such (and keeps the task waiting in a delay queue, never
running it unguarded) instead of blaming a Redis that is up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel

from tests.conftest import wait_until
from weclaw_mq import App, StateCommandError, StateUnavailableError, TaskStatus
from weclaw_mq.contract.naming import cancel_key
from weclaw_mq.state import RedisTaskStore, new_owner


class Job(BaseModel):
    text: str


async def test_a_claim_redis_refuses_raises_a_command_error_not_an_outage(
    redis_url: str, qname: str
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    # What WECLAW_MQ_GUARD_LEASE_S=1e-9 once reached: a lease of 0 ms, which Redis refuses
    # ("invalid expire time"). The settings refuse it now; the store is made by hand here.
    store = RedisTaskStore(client, ttl_s=60, lease_s=1e-9, done_ttl_s=60)
    try:
        with pytest.raises(StateCommandError) as caught:
            await store.claim(qname, "t-1", new_owner())
    finally:
        keys = [k async for k in client.scan_iter(f"*{qname}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    assert not isinstance(caught.value, StateUnavailableError)
    assert "invalid expire time" in str(caught.value)
    assert "not an outage" in str(caught.value)


async def test_a_worker_whose_claim_redis_refuses_says_so_and_runs_the_task_once_it_is_fixed(
    make_app: Callable[..., App],
    start_worker: Callable[..., object],
    redis_url: str,
    qname: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(retry_delay_s=0.2)
    ran: list[str] = []

    @app.handler(qname)
    async def handle(job: Job) -> str:
        ran.append(job.text)
        return job.text

    task_id = f"{qname}-task"
    client = aioredis.Redis.from_url(redis_url)
    try:
        # A value of the wrong type where the claim script reads a set: WRONGTYPE, every time.
        await client.set(cancel_key(task_id), "not a set", ex=60)
        caplog.set_level(logging.WARNING, logger="weclaw_mq")
        await app.declare()
        await app.publish(qname, {"text": "hello"}, task_id=task_id)
        await start_worker(app)
        await wait_until(
            lambda: "refused the claim" in caplog.text, 15, "the worker to say Redis refused"
        )
        assert ran == [], "a claim Redis refused never runs the handler"
        assert "task store unavailable" not in caplog.text, caplog.text
        refused = [r for r in caplog.records if "refused the claim" in r.getMessage()]
        assert refused[0].levelno == logging.ERROR
        assert "WRONGTYPE" in refused[0].getMessage() or "wrong kind" in refused[0].getMessage()

        await client.delete(cancel_key(task_id))  # the cause fixed: the waiting task runs
        await wait_until(lambda: ran == ["hello"], 15, "the task to run once Redis accepts")
        state = await app.result(task_id, queue=qname, timeout_s=10)
        assert state.status is TaskStatus.SUCCEEDED
    finally:
        await client.delete(cancel_key(task_id))
        await client.aclose()

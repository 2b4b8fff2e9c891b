"""The example API (``producers.api``) served by a real uvicorn: an ``Idempotency-Key`` names
one body (409 for another), and ``GET /tasks/{id}`` answers 503 with ``Retry-After`` while
Redis is down (a private redis-server this test stops), 501 where results are turned off.

Real broker; Redis is the shared one, or a private one stopped mid-test, or a closed port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
from aio_pika.abc import AbstractChannel

from consumers import demo
from producers.api import RETRY_AFTER_S, create_app
from tests.conftest import close_and_delete_queues, settings_for
from tests.integration.dead_endpoints import closed_port
from tests.integration.live_server import serving
from tests.private_servers import PrivateRedis
from weclaw_mq import App


@contextlib.asynccontextmanager
async def served(mq: App, queue: str) -> AsyncIterator[httpx.AsyncClient]:
    """The demo API over ``mq`` (demo handler on ``queue``, declared at startup), served by
    uvicorn on a free port, and a client of it."""
    demo.register(mq, queue=queue)
    async with serving(create_app(mq)) as url, httpx.AsyncClient(base_url=url) as client:
        yield client


@contextlib.asynccontextmanager
async def own_app(broker_url: str, redis_url: str, **overrides: object) -> AsyncIterator[App]:
    """An App on the shared broker and ``redis_url`` (not the shared Redis, so not
    ``make_app``); its handlers' queues are deleted at the end."""
    mq = App("api-outage", settings=settings_for(broker_url, redis_url, **overrides))
    try:
        yield mq
    finally:
        await close_and_delete_queues([mq], broker_url)


async def test_the_same_key_answers_the_first_task_and_another_body_answers_409(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    key = f"order-{qname}"
    async with served(make_app("api-keys"), qname) as client:
        first = await client.post("/tasks", json={"text": "hi"}, headers={"Idempotency-Key": key})
        retry = await client.post("/tasks", json={"text": "hi"}, headers={"Idempotency-Key": key})
        other = await client.post(
            "/tasks", json={"text": "something else"}, headers={"Idempotency-Key": key}
        )
        status = await client.get(f"/tasks/{key}")
        depth = await amqp.declare_queue(qname, passive=True)

    assert first.status_code == retry.status_code == 202, (first.text, retry.text)
    assert first.json() == retry.json() == {"task_id": key}
    assert other.status_code == 409, other.text
    detail = other.json()["detail"]
    assert "another body" in detail["message"] and detail["task_id"] == key
    # The record is the first body's task, and the refused body never reached the queue: the
    # first publish and its retry (a duplicate the worker's guard acks unrun) are there.
    assert status.status_code == 200 and status.json()["status"] == "queued"
    assert depth.declaration_result.message_count == 2


async def test_get_answers_503_with_retry_after_while_redis_is_down_and_again_once_it_is_back(
    broker_url: str, private_redis: PrivateRedis, qname: str
) -> None:
    async with (
        own_app(broker_url, private_redis.url, redis_timeout_s=1.0) as mq,
        served(mq, qname) as client,
    ):
        posted = await client.post("/tasks", json={"text": "hi"})
        task_id = posted.json()["task_id"]
        before = await client.get(f"/tasks/{task_id}")
        private_redis.stop()
        while_down = await client.get(f"/tasks/{task_id}")
        # Publishing needs no Redis: the task is accepted, its "queued" record is skipped.
        accepted = await client.post(
            "/tasks", json={"text": "while down"}, headers={"Idempotency-Key": f"d-{qname}"}
        )
        private_redis.start()
        after = await client.get(f"/tasks/{task_id}")

    assert posted.status_code == 202 and before.status_code == 200, (posted.text, before.text)
    assert while_down.status_code == 503, while_down.text
    assert while_down.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert while_down.json() == {"detail": {"message": "task statuses are unavailable right now"}}
    assert "redis" not in while_down.text.lower()  # where Redis is stays in the server's log
    assert accepted.status_code == 202, accepted.text
    # The private Redis keeps nothing across a restart (no append-only file): the record
    # written before the outage is gone, and the API answers again (404, not 503).
    assert after.status_code == 404, after.text


async def test_with_results_off_post_works_without_redis_and_get_answers_501(
    broker_url: str, qname: str
) -> None:
    dead_redis = f"redis://127.0.0.1:{closed_port()}/0"
    key = f"k-{qname}"
    async with (
        own_app(broker_url, dead_redis, results_enabled=False) as mq,
        served(mq, qname) as client,
    ):
        posted = await client.post("/tasks", json={"text": "hi"}, headers={"Idempotency-Key": key})
        read = await client.get(f"/tasks/{key}")

    assert posted.status_code == 202 and posted.json() == {"task_id": key}, posted.text
    assert read.status_code == 501, read.text
    assert "WECLAW_MQ_RESULTS_ENABLED" in read.json()["detail"]

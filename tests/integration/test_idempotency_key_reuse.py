"""A task id of the caller's names one body (``weclaw_mq.state.reuse``): with
``refuse_other_body=True``, published again with the same body it is the same task, with
another body ``IdempotencyConflictError`` and nothing is sent; without it nothing is compared.
Real broker, real Redis; the outbox case with a broker on a closed port."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import close_and_delete_queues, forget_task_keys, queue_depth, settings_for
from tests.integration.dead_endpoints import closed_port, silent_server
from weclaw_mq import App, IdempotencyConflictError
from weclaw_mq.contract.naming import body_key


class Ask(BaseModel):
    text: str
    user: str = "u"


def with_handler(app: App, queue: str) -> App:
    @app.handler(queue)
    async def answer(ask: Ask) -> str:
        return ask.text

    return app


async def test_by_default_nothing_is_compared_and_no_fingerprint_is_kept(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel, redis_url: str
) -> None:
    # The check costs a Redis round trip before each publish, so it is asked for, not assumed.
    mq = with_handler(make_app("reuse-off"), qname)
    await mq.declare()
    key = f"order-{qname}"

    assert await mq.publish(qname, {"text": "a haiku"}, task_id=key) == key
    assert await mq.publish(qname, {"text": "a limerick"}, task_id=key) == key

    assert await queue_depth(amqp, qname) == 2  # both sent; the guard runs the first to arrive
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.exists(body_key(qname, key)) == 0
    finally:
        await client.aclose()
        await forget_task_keys(redis_url, [qname])


async def test_the_same_key_with_another_body_is_refused_and_nothing_is_sent(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    mq = with_handler(make_app("reuse"), qname)
    await mq.declare()
    key = f"order-{qname}"

    first = await mq.publish(
        qname, {"text": "a haiku", "user": "u1"}, task_id=key, refuse_other_body=True
    )
    with pytest.raises(IdempotencyConflictError) as refused:
        await mq.publish(
            qname, {"text": "a limerick", "user": "u1"}, task_id=key, refuse_other_body=True
        )
    # One JSON value in another key order is the same body: the retry goes out as before
    # (a duplicate the guard acks unrun) under the first task id.
    again = await mq.publish(
        qname, {"user": "u1", "text": "a haiku"}, task_id=key, refuse_other_body=True
    )

    assert first == again == key
    assert refused.value.task_id == key and refused.value.queue == qname
    assert "another body" in str(refused.value)
    assert await queue_depth(amqp, qname) == 2  # the first body and its retry, not the limerick


async def test_a_key_is_per_queue_and_a_new_key_takes_any_body(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    other = f"{qname}-b"
    mq = with_handler(with_handler(make_app("reuse"), qname), other)
    await mq.declare()
    key = f"k-{qname}"

    await mq.publish(qname, {"text": "one"}, task_id=key, refuse_other_body=True)
    await mq.publish(
        other, {"text": "two"}, task_id=key, refuse_other_body=True
    )  # another queue: its own key
    await mq.publish(qname, {"text": "three"}, task_id=f"{key}-2", refuse_other_body=True)
    await mq.publish(qname, {"text": "four"})  # no key of the caller's: never compared

    assert await queue_depth(amqp, qname) == 3
    assert await queue_depth(amqp, other) == 1


async def test_the_fingerprint_lives_as_long_as_the_tasks_record(
    make_app: Callable[..., App], qname: str, redis_url: str
) -> None:
    mq = with_handler(make_app("reuse", result_ttl_s=600), qname)
    await mq.declare()
    key = f"ttl-{qname}"
    await mq.publish(qname, {"text": "x"}, task_id=key, ttl_s=60, refuse_other_body=True)

    client = aioredis.Redis.from_url(redis_url)
    try:
        ttl_ms = await client.pttl(body_key(qname, key))
    finally:
        await client.aclose()
    # The task's lifetime plus the record TTL (state.expiry.record_ttl_s): 660 s, not less.
    assert 600_000 < ttl_ms <= 660_000


async def test_the_outbox_keeps_the_first_body_while_the_broker_is_down(
    redis_url: str, qname: str, tmp_path: Path
) -> None:
    dead = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"
    mq = with_handler(
        App(
            "reuse-down",
            settings=settings_for(
                dead, redis_url, outbox_path=str(tmp_path / "o.db"), outbox_relay_in_app=False
            ),
        ),
        qname,
    )
    key = f"local-{qname}"
    try:
        stored = await mq.publish(qname, {"text": "first"}, task_id=key, refuse_other_body=True)
        with pytest.raises(IdempotencyConflictError):
            await mq.publish(qname, {"text": "second"}, task_id=key, refuse_other_body=True)
        retried = await mq.publish(qname, {"text": "first"}, task_id=key, refuse_other_body=True)
        outbox = await mq.start_outbox()
        rows = await outbox.find(key)
        assert stored == retried == key
        assert rows == qname and await mq.stored_locally(key)
        status = await mq.status(key)
        assert status is not None and status.status.value == "stored_locally"
    finally:
        await mq.close()
        await forget_task_keys(redis_url, [qname])


async def test_a_redis_that_never_answers_skips_the_check_and_the_task_is_published(
    broker_url: str, qname: str, amqp: AbstractChannel
) -> None:
    async with silent_server() as port:
        hung = f"redis://127.0.0.1:{port}/0"
        mq = App("hung-redis", settings=settings_for(broker_url, hung, redis_timeout_s=1))
        with_handler(mq, qname)
        try:
            await mq.declare()
            key = f"k-{qname}"
            published = await mq.publish(qname, {"text": "a"}, task_id=key, refuse_other_body=True)
            depth = await queue_depth(amqp, qname)
        finally:
            await close_and_delete_queues([mq], broker_url)

    assert published == key
    assert depth == 1


async def test_without_results_nothing_is_compared_and_publishing_needs_no_redis(
    broker_url: str, qname: str, amqp: AbstractChannel
) -> None:
    # Results off and an unguarded handler: this App never opens Redis (a closed port here).
    dead_redis = f"redis://127.0.0.1:{closed_port()}/0"
    mq = App("no-results", settings=settings_for(broker_url, dead_redis, results_enabled=False))

    @mq.handler(qname, idempotent=False)
    async def answer(ask: Ask) -> str:
        return ask.text

    try:
        await mq.declare()
        key = f"k-{qname}"
        assert await mq.publish(qname, {"text": "a"}, task_id=key, refuse_other_body=True) == key
        assert await mq.publish(qname, {"text": "b"}, task_id=key, refuse_other_body=True) == key
        assert await queue_depth(amqp, qname) == 2
        assert mq.store is None
    finally:
        await close_and_delete_queues([mq], broker_url)

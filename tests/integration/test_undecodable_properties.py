"""The fastest safe way out for a message whose properties the client cannot decode.

Without help, aiormq closes the whole connection on such a message: the broker returns it,
with every other unacked message of that connection, and the next consumer meets it again
until the queue's delivery limit dead-letters it (measured with a worker at concurrency 4 and
the default limit of 10: 42 s, and three innocent tasks dead-lettered with it). Read with
``tolerant_properties`` held, it arrives as a marker, and one basic.reject without requeue has
the broker itself move the untouched original to ``Q.dlq``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractChannel
from pamqp.commands import Basic
from pydantic import BaseModel

from tests.conftest import queue_depth, wait_until
from tests.integration.raw_amqp import publish_undecodable
from weclaw_mq import App
from weclaw_mq.admin import dlq
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.contract.undecodable import tolerant_properties, undecodable


class Prompt(BaseModel):
    text: str


async def test_an_undecodable_message_rejected_once_lands_untouched_in_the_dlq(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel, broker_url: str
) -> None:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    await publish_undecodable(broker_url, qname, b'{"text": "bad"}')
    await app.publish(qname, Prompt(text="innocent"), task_id="innocent-1")

    started = asyncio.get_running_loop().time()
    with tolerant_properties():
        conn = await app.broker.connect(name="test-consumer")
        try:
            raw = await (await conn.channel()).get_underlay_channel()
            got = await raw.basic_get(qname, no_ack=False)
            assert isinstance(got.delivery, Basic.GetOk)
            assert undecodable(got.header.properties.headers) is not None
            await raw.basic_reject(got.delivery.delivery_tag, requeue=False)
            # The connection survived the bad message: the next one is read normally.
            after = await raw.basic_get(qname, no_ack=False)
            assert after.header.properties.message_id == "innocent-1"
            await raw.basic_nack(after.delivery.delivery_tag, requeue=True)  # type: ignore[union-attr]
        finally:
            await conn.close()

    await wait_until(lambda: _depth_is(amqp, dlq_name(qname), 1), 10, "the dead-lettered copy")
    assert asyncio.get_running_loop().time() - started < 10
    [letter] = await dlq.inspect(app, qname)
    assert letter.reason == "undecodable_properties"
    assert b"\xff\xfe\xfd\xfc" in bytes(letter.headers[h.UNDECODABLE_PROPERTIES])
    assert letter.body == b'{"text": "bad"}'
    assert await queue_depth(amqp, qname) == 1  # the innocent task is still in its queue


async def _depth_is(channel: AbstractChannel, queue: str, n: int) -> bool:
    return await queue_depth(channel, queue) == n


async def test_a_worker_rejects_an_undecodable_message_at_once_and_keeps_serving(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: AbstractChannel,
    broker_url: str,
) -> None:
    """In a live worker: the bad message reaches Q.dlq in one delivery, the connection stays
    up, and the tasks around it run once each (none is dead-lettered with it)."""
    app = make_app()
    handled: list[str] = []

    @app.handler(qname)
    async def work(task: Prompt) -> None:
        handled.append(task.text)

    await app.declare()
    await app.publish(qname, Prompt(text="before"))
    await publish_undecodable(broker_url, qname, b'{"text": "bad"}')
    await app.publish(qname, Prompt(text="after"))
    worker = await start_worker(app, concurrency=4)

    await wait_until(lambda: _depth_is(amqp, dlq_name(qname), 1), 10, "the rejected original")
    await wait_until(lambda: sorted(handled) == ["after", "before"], 10, "the innocent tasks")
    [letter] = await dlq.inspect(app, qname)
    assert letter.reason == "undecodable_properties"
    assert letter.body == b'{"text": "bad"}'
    assert worker.ready.is_set()  # never lost its connection
    assert app.metrics.reconnects.labels("worker").value == 0

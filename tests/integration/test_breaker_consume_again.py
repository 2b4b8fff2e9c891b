"""A circuit breaker that opens while the worker subscribes its queue again (the broker
cancelled the consumer: its queue was deleted and re-declared) leaves the queue paused, and its
resume adds exactly one consumer.

Before the fix the session loop popped the cancelled tag, the breaker's ``pause()`` found no
consumer to cancel, and the loop then registered its new one: the queue kept delivering while
health said "paused", and a resume added a second consumer (twice the prefetch). The test holds
the re-subscription inside its declare, opens the breaker there, and reads the broker's own
consumer count. Real broker; the queue is this test's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import weclaw_mq.worker.subscriptions as subscriptions_module
from tests.conftest import wait_until
from weclaw_mq import App, Breaker, Worker


async def broker_consumers(amqp: Any, queue: str) -> int:
    """The queue's consumers as its leader counts them (a passive declare): rabbitmqctl's
    list_consumers read 0 for a live consumer once, in a run of two suites at once."""
    declared = await amqp.declare_queue(queue, passive=True)
    return int(declared.declaration_result.consumer_count or 0)


async def test_a_breaker_opening_during_a_resubscription_keeps_the_queue_paused(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = make_app("breaker-resubscribe")

    @app.handler(qname, breaker=Breaker(failures=1, window_s=60, cooldown_s=600, on=Exception))
    async def work(task: dict[str, str]) -> None:
        return None

    holding = asyncio.Event()
    inside = asyncio.Event()
    release = asyncio.Event()
    real_declare = subscriptions_module.declare

    async def declare(channel: Any, specs: Any) -> Any:
        declared = await real_declare(channel, specs)
        if holding.is_set():  # the re-subscription's declare: wait here, the old tag popped
            inside.set()
            await release.wait()
        return declared

    paused: list[Any] = []
    real_pause = subscriptions_module._SingleConsumer.pause

    async def pause(self: Any) -> None:
        await real_pause(self)
        paused.append(self)

    monkeypatch.setattr(subscriptions_module, "declare", declare)
    monkeypatch.setattr(subscriptions_module._SingleConsumer, "pause", pause)
    worker: Worker = await start_worker(app, concurrency=2, broker_load_check=False)
    assert await broker_consumers(amqp, qname) == 1

    holding.set()
    await amqp.queue_delete(qname)  # the broker cancels the consumer (basic.cancel)
    await asyncio.wait_for(inside.wait(), 20)
    worker._circuits[qname].outcome(object(), RuntimeError("the upstream is down"))  # type: ignore[arg-type]
    await wait_until(lambda: paused, 20, "the breaker's pause()")
    release.set()
    await wait_until(lambda: qname not in worker._recovering, 20, "the re-subscription")

    assert await broker_consumers(amqp, qname) == 0, "a paused queue still has a consumer"

    await paused[0].resume()  # what the breaker's watch does after a good probe
    assert await broker_consumers(amqp, qname) == 1
    await paused[0].resume()  # a second resume adds no second consumer
    assert await broker_consumers(amqp, qname) == 1

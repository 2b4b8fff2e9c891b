"""A stopping worker gives each delivery back once, after its consumers are cancelled.

While a stop waits for the broker to confirm a consumer's cancel, that consumer still
receives. A delivery given back at once then came straight back to it, again and again, each
return counting toward the queue's delivery limit, until the broker dead-lettered a task
nobody had run (seen once in a loaded full run: three give-backs in 11 ms, the task in
``Q.dlq``). The test holds the bulk consumer's cancel open, publishes a task into that window,
and reads where the task ends. Real broker; the queues are this test's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aio_pika

from tests.conftest import queue_depth, wait_until
from weclaw_mq import App, Worker
from weclaw_mq.contract.naming import dlq_name


async def test_a_task_that_arrives_during_the_stop_is_given_back_once_not_dead_lettered(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    amqp: aio_pika.abc.AbstractChannel,
) -> None:
    app = make_app("lanes-stop")
    release_handler = asyncio.Event()
    started: list[str] = []

    @app.handler(qname, priorities=True, delivery_limit=2)
    async def work(task: dict[str, str]) -> None:
        started.append(task["name"])
        await release_handler.wait()

    worker: Worker = await start_worker(app, concurrency=2, broker_load_check=False)
    async with app:
        await app.publish(qname, {"name": "first"})
        await wait_until(lambda: started == ["first"], 20, "the first task to start")

        [scheduler] = worker._schedulers
        bulk_queue = scheduler._consumers.bulk_queue
        assert bulk_queue is not None, "the bulk consumer (concurrency + 1) is not open"
        cancel_entered, cancel_may_go = asyncio.Event(), asyncio.Event()

        class HeldCancel:
            """The bulk consumer's queue, whose cancel waits until the test lets it go."""

            def __getattr__(self, name: str) -> Any:
                return getattr(bulk_queue, name)

            async def cancel(self, tag: str, *args: Any, **kwargs: Any) -> Any:
                cancel_entered.set()
                await cancel_may_go.wait()
                return await bulk_queue.cancel(tag, *args, **kwargs)

        scheduler._consumers.bulk_queue = HeldCancel()  # type: ignore[assignment]
        worker.stop()
        await asyncio.wait_for(cancel_entered.wait(), 20)
        # The bulk consumer is live and stopping: this task reaches it now.
        await app.publish(qname, {"name": "late"})

        async def landed() -> bool:  # held for the stop, or (before the fix) looped to the DLQ
            waiting = bool(scheduler._waiting[scheduler._lowest])
            return waiting or await queue_depth(amqp, dlq_name(qname)) > 0

        await wait_until(landed, 20, "the late delivery to land")
        cancel_may_go.set()
        release_handler.set()
        await wait_until(lambda: not worker.ready.is_set(), 30, "the worker to stop")

    async def settled() -> int:  # back in its queue, or dead-lettered
        return await queue_depth(amqp, qname) + await queue_depth(amqp, dlq_name(qname))

    await wait_until(settled, 20, "the late task to be given back")
    assert started == ["first"]
    assert await queue_depth(amqp, dlq_name(qname)) == 0, "a task nobody ran was dead-lettered"
    assert await queue_depth(amqp, qname) == 1

"""A worker started while Redis does not answer says so at start, once, and what it does.

It consumes meanwhile (a guarded task waits in its delay queue, never runs unguarded), so
without this line its log reads as healthy: "consuming", then a retry of the cancel
subscription every 2 s.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import BaseModel

from tests.conftest import delete_queues, settings_for, wait_until
from tests.integration.dead_endpoints import closed_port
from weclaw_mq import App, Worker
from weclaw_mq.wire.topology import queue_declarations

UNHEARD = "cancel requests unheard"


class Job(BaseModel):
    text: str


async def test_a_worker_started_without_redis_says_once_what_is_unreachable_and_what_it_does(
    broker_url: str,
    qname: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = closed_port()
    app = App("test", settings=settings_for(broker_url, f"redis://127.0.0.1:{port}/0"))

    @app.handler(qname)
    async def handle(job: Job) -> str:
        return job.text

    caplog.set_level(logging.DEBUG, logger="weclaw_mq")
    worker = Worker(app)
    running = asyncio.create_task(worker.run())
    try:
        await wait_until(
            lambda: "does not answer" in caplog.text, 15, "the worker to say Redis does not answer"
        )
        # Several failed subscriptions later (each logged), still one warning about each.
        await wait_until(
            lambda: caplog.text.count(UNHEARD) >= 3, 15, "three failed cancel subscriptions"
        )
        assert worker.ready.is_set(), "it consumes meanwhile"
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)
        await app.close()
        await delete_queues(
            broker_url, [n for n, _ in queue_declarations(app.handlers[qname].queue_spec())]
        )

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = [m for m in warnings if "does not answer" in m]
    assert len(said) == 1, warnings
    assert f"127.0.0.1:{port}" in said[0]
    assert "the worker consumes" in said[0]
    assert "guarded tasks wait in their delay queues" in said[0]
    assert "cancel requests go unheard" in said[0]
    assert len([m for m in warnings if UNHEARD in m]) == 1, warnings

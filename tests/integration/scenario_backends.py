"""The two places a scenario runs, for the suites that assert the same lines on both: the
test kit's ``TestBroker`` in memory, and the shared RabbitMQ and Redis with a real ``Worker``.

Each suite subclasses these with its own steps (``start``, ``open``, ``run``...); what the two
suites shared (building the app, reading a task's final state and the dead letters, publishing
a raw body as a producer that is not an App) is written here once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import aio_pika

from weclaw_mq import App, Settings, TaskState
from weclaw_mq.admin import dlq
from weclaw_mq.testing import DeadLetter, TestBroker

WAIT_S = 30.0
# Nothing answers there: a memory scenario that touched a broker or Redis by mistake fails.
UNREACHABLE = {"amqp_url": "amqp://guest:guest@127.0.0.1:1/", "redis_url": "redis://127.0.0.1:1"}


class MemoryBackend:
    """``TestBroker``: ``open_broker`` starts it on the app; ``final`` runs it until idle."""

    name = "memory"
    app_name = "memory"

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack
        self.broker: TestBroker | None = None

    def app(self, **settings: Any) -> App:
        merged = {**UNREACHABLE, **settings}
        return App(self.app_name, settings=Settings(_env_file=None, **merged))  # type: ignore[call-arg]

    async def open_broker(self, app: App) -> None:
        self.broker = await self.stack.enter_async_context(TestBroker(app))

    def _broker(self) -> TestBroker:
        assert self.broker is not None, "open the broker first"
        return self.broker

    async def final(self, app: App, task_id: str, queue: str | None = None) -> TaskState:
        await self._broker().run_until_idle()
        state = await app.status(task_id, queue=queue)
        assert state is not None and state.status.terminal, state
        return state

    async def dead_letters(self, app: App, queue: str) -> list[DeadLetter]:
        return self._broker().dead_letters(queue)


class RealBackend:
    """The shared services: apps from ``make_app`` (cleaned up by it), workers from
    ``start_worker``, raw bodies published with plain aio-pika."""

    name = "rabbitmq"

    def __init__(
        self, make_app: Callable[..., App], start_worker: Callable[..., Any], broker_url: str
    ) -> None:
        self.make_app = make_app
        self.start_worker = start_worker
        self.broker_url = broker_url

    async def final(self, app: App, task_id: str, queue: str | None = None) -> TaskState:
        return await app.result(task_id, queue=queue, timeout_s=WAIT_S)

    async def dead_letters(self, app: App, queue: str) -> list[DeadLetter]:
        return await dlq.inspect(app, queue)

    async def publish_body(
        self, queue: str, body: bytes, task_id: str, headers: Mapping[str, Any] | None = None
    ) -> None:
        """As a producer that is not an App: no model check; confirmed by the broker."""
        conn = await aio_pika.connect(self.broker_url)
        try:
            channel = await conn.channel(publisher_confirms=True)
            message = aio_pika.Message(
                body,
                message_id=task_id,
                content_type="application/json",
                headers=dict(headers or {}),
            )
            await channel.default_exchange.publish(message, routing_key=queue)
        finally:
            await conn.close()

"""The first publish, before any worker or ``declare`` ran: its ``UnroutableError`` names the
exact command (``weclaw-mq declare MODULE:APP``), and an App made with ``declare=True``
declares its queues itself, once, and publishes. Real broker and Redis."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import close_apps, forget_task_keys, load_module, settings_for
from tests.integration.dead_endpoints import closed_port
from weclaw_mq import App, BatchPublishError, TaskStatus, UnroutableError

MODULE = """from weclaw_mq import App, Settings

app = App("first-publish", settings=Settings(amqp_url={amqp!r}, redis_url={redis!r}))


@app.handler({queue!r})
async def reply(task: dict) -> dict:
    return task
"""


@pytest.fixture
async def cleanup(broker_url: str, redis_url: str) -> AsyncIterator[list[App]]:
    apps: list[App] = []
    yield apps
    await close_apps(apps, broker_url, redis_url)


def load(folder: Path, name: str, **values: str) -> Any:
    path = folder / f"{name}.py"
    path.write_text(MODULE.format(**values))
    return load_module(path, name, register=True)


async def test_an_undeclared_queue_names_the_command_that_declares_it(
    broker_url: str, redis_url: str, qname: str, tmp_path: Path, cleanup: list[App]
) -> None:
    module_name = f"first_publish_{qname.replace('-', '_')}"
    module = load(tmp_path, module_name, amqp=broker_url, redis=redis_url, queue=qname)
    cleanup.append(module.app)
    try:
        async with module.app:
            with pytest.raises(UnroutableError) as raised:
                await module.app.publish(qname, {"text": "hi"})
            with pytest.raises(BatchPublishError) as raised_many:
                await module.app.publish_many(qname, [{"text": "hi"}])
    finally:
        del sys.modules[module_name]

    [many] = raised_many.value.failed.values()
    assert isinstance(many, UnroutableError)
    for error in (raised.value, many):
        assert f"run 'weclaw-mq declare {module_name}:app'" in str(error), str(error)
        assert "App(..., declare=True)" in str(error)
        assert error.queue == qname


async def test_an_app_made_with_declare_declares_once_then_publishes(
    broker_url: str,
    redis_url: str,
    qname: str,
    cleanup: list[App],
    start_worker: Callable[..., Any],
) -> None:
    app = App("owns-its-queues", settings=settings_for(broker_url, redis_url), declare=True)
    cleanup.append(app)
    declares = 0
    declare = app.declare

    async def counted() -> list[str]:
        nonlocal declares
        declares += 1
        return await declare()

    app.declare = counted  # type: ignore[method-assign]

    @app.handler(qname)
    async def reply(task: dict[str, str]) -> dict[str, str]:
        return task

    async with app:
        # Three at once, before the queue exists: one declare serves them all.
        ids = await asyncio.gather(*(app.publish(qname, {"n": str(i)}) for i in range(3)))
        ids += await app.publish_many(qname, [{"n": "3"}])
        await start_worker(app)
        finals = [await app.result(task_id, timeout_s=30) for task_id in ids]

    assert declares == 1
    assert [f.status for f in finals] == [TaskStatus.SUCCEEDED] * 4


async def test_with_the_outbox_a_broker_that_is_away_takes_the_task_there_instead(
    redis_url: str, qname: str, tmp_path: Path
) -> None:
    settings = settings_for(
        f"amqp://guest:guest@127.0.0.1:{closed_port()}/",
        redis_url,
        outbox_path=str(tmp_path / "outbox.db"),
        confirm_timeout_s=2,
    )
    app = App("declares-offline", settings=settings, declare=True)

    @app.handler(qname)
    async def reply(task: dict[str, str]) -> dict[str, str]:
        return task

    try:
        async with app:
            task_id = await app.publish(qname, {"text": "while the broker is away"})
            state = await app.status(task_id)
    finally:
        await app.close()
        await forget_task_keys(redis_url, [qname])

    assert state is not None and state.status is TaskStatus.STORED_LOCALLY

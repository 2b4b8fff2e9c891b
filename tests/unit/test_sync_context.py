"""A plain-def handler's Context from its thread (``emit_sync``, ``publish_sync``,
``cancelled``), on the test kit's broker, which runs it in threads as a worker does; and the
blocking calls refused where they would stall an event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from weclaw_mq import App, Context, RetryPolicy, Settings, TaskStatus
from weclaw_mq.testing import TestBroker

Q = "sync-q"
NEXT = "sync-next"


def offline_app() -> App:
    """An app whose broker and Redis do not exist: only the test broker can serve it."""
    return App(
        "sync",
        settings=Settings(  # type: ignore[call-arg]
            _env_file=None,
            amqp_url="amqp://guest:guest@127.0.0.1:1/",
            redis_url="redis://127.0.0.1:1",
        ),
    )


async def test_a_plain_def_streams_and_publishes_from_its_thread_on_the_test_broker() -> None:
    app = offline_app()
    seen: list[tuple[str, bool]] = []

    @app.handler(Q)
    def speak(task: dict[str, str], ctx: Context) -> str:
        seen.append((threading.current_thread().name, ctx.cancelled))
        ctx.emit_sync(task["text"])
        ctx.publish_sync(NEXT, {"text": task["text"] + "!"})
        return task["text"]

    @app.handler(NEXT)
    async def shout(task: dict[str, str], ctx: Context) -> str:
        return f"{task['text']} ({ctx.trace_id})"

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"text": "hi"}, trace_id="trace-kit")
        await broker.run_until_idle()
        state = await app.status(task_id)
        events = [e async for e in app.stream(task_id)]
        assert broker.outcomes(NEXT) == {"acked": 1}

    assert state is not None and (state.status, state.result) == (TaskStatus.SUCCEEDED, "hi")
    assert [(e.kind, e.data) for e in events[:2]] == [("attempt", None), ("chunk", "hi")]
    ((thread, cancelled),) = seen
    assert thread.startswith("weclaw-mq-sync-") and cancelled is False


async def test_emit_sync_in_an_async_def_fails_its_attempt_instead_of_stalling_the_loop() -> None:
    app = offline_app()

    @app.handler(Q, retry=RetryPolicy(max_retries=0))
    async def wrong(task: dict[str, str], ctx: Context) -> None:
        ctx.emit_sync("blocks")

    async with TestBroker(app) as broker:
        task_id = await app.publish(Q, {"text": "hi"})
        await broker.run_until_idle()
        state = await app.status(task_id)

    assert state is not None and state.status is TaskStatus.DEAD_LETTERED
    assert state.error is not None and "await ctx.emit(...)" in state.error, state.error


async def test_a_context_no_worker_built_for_a_plain_def_says_so() -> None:
    ctx = Context(
        task_id="t",
        trace_id="r",
        queue=Q,
        attempt=1,
        redelivered=False,
        headers={},
        app=None,  # type: ignore[arg-type]
    )

    def in_a_thread() -> Any:
        with pytest.raises(RuntimeError, match="no event loop"):
            ctx.emit_sync("x")
        with pytest.raises(RuntimeError, match="no event loop"):
            ctx.publish_sync(Q, {})
        return True

    assert await asyncio.to_thread(in_a_thread)

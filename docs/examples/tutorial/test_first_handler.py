"""Step 5 of the tutorial (docs/tutorial/05-testing.md includes this file as it is): step 1's
handler tested with weclaw_mq.testing, no RabbitMQ or Redis needed. Run: pytest -q"""

from __future__ import annotations

import first_handler
import pytest
from first_handler import QUEUE, Prompt, app

from weclaw_mq import TaskStatus
from weclaw_mq.testing import TestBroker


@pytest.mark.asyncio
async def test_a_prompt_gets_its_reply() -> None:
    async with TestBroker(app) as broker:
        task_id = await app.publish(QUEUE, Prompt(text="Write a haiku"))
        await broker.run_until_idle()  # every delivery runs through the worker's own code
        state = await app.status(task_id)

    assert state is not None and state.status is TaskStatus.SUCCEEDED
    assert state.result == {"reply": "echo: Write a haiku"}


@pytest.mark.asyncio
async def test_a_failing_model_is_retried_then_dead_lettered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def down(text: str) -> str:
        raise ConnectionError("the model did not answer")

    monkeypatch.setattr(first_handler, "call_model", down)
    async with TestBroker(app) as broker:
        task_id = await app.publish(QUEUE, Prompt(text="Write a haiku"))
        await broker.run_until_idle()  # 5 s, 10 s and 20 s of retries, not waited
        state = await app.status(task_id)
        waits = broker.waits(QUEUE)
        [dead] = broker.dead_letters(QUEUE)  # as `weclaw-mq dlq list` would show it

    assert state is not None and state.status is TaskStatus.DEAD_LETTERED
    assert (state.reason, state.attempt) == ("retries_exhausted", 4)
    assert waits == [5.0, 10.0, 20.0]
    assert (dead.reason, dead.error_type) == ("retries_exhausted", "ConnectionError")


@pytest.mark.asyncio
async def test_an_empty_prompt_is_rejected_without_a_retry() -> None:
    async with TestBroker(app) as broker:
        task_id = await app.publish(QUEUE, Prompt(text="   "))
        await broker.run_until_idle()
        state = await app.status(task_id)
        waits = broker.waits(QUEUE)

    assert state is not None and state.status is TaskStatus.DEAD_LETTERED
    assert state.reason == "rejected"
    assert waits == []

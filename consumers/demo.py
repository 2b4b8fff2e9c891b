"""The demo worker: an AI-reply handler on queue ``ai-tasks`` that calls a stand-in LLM.

Run it with ``weclaw-mq worker consumers.demo:app --concurrency 4``; ``make demo`` does that
for you and publishes a few prompts (see ``consumers.demo_run``).

Environment (read on every call, so a test can change it without re-importing):

- ``DEMO_QUEUE`` (read at import): the queue name, default ``ai-tasks``.
- ``DEMO_LLM_LATENCY_S``: how long one stand-in model call takes, default 0.2.
- ``DEMO_LLM_FAILURE_RATE``: the chance that a call raises, default 0.2, so retries show.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from pydantic import BaseModel

from weclaw_mq import App, Context, RetryPolicy

DEFAULT_QUEUE = "ai-tasks"
MODEL_NAME = "stand-in"

# Short delays so a demo run shows retries within seconds (0.5 s, 1 s, 2 s, then the DLQ);
# production keeps the settings' defaults of 5 s, 10 s, 20 s.
DEMO_RETRY = RetryPolicy(max_retries=3, delay_s=0.5, multiplier=2.0, max_delay_s=5.0)


class Prompt(BaseModel):
    text: str
    user_id: str | None = None


class StandInLLMError(RuntimeError):
    """What the stand-in model raises on a simulated outage (a 429 or 503 in real life)."""


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def reply_to(prompt: str) -> str:
    """What the stand-in model answers (deterministic, so tests can compare)."""
    return f"(stand-in reply) {prompt}"


async def stand_in_llm(prompt: str) -> str:
    """Takes ``DEMO_LLM_LATENCY_S`` and fails with probability ``DEMO_LLM_FAILURE_RATE``."""
    latency_s = _env_float("DEMO_LLM_LATENCY_S", 0.2)
    failure_rate = _env_float("DEMO_LLM_FAILURE_RATE", 0.2)
    await asyncio.sleep(latency_s)
    if random.random() < failure_rate:
        raise StandInLLMError("stand-in model overloaded (simulated)")
    return reply_to(prompt)


async def answer(task: Prompt, ctx: Context) -> dict[str, Any]:
    ctx.logger.info("calling %s for user %s", MODEL_NAME, task.user_id or "-")
    reply = await stand_in_llm(task.text)
    # The return value is what the result store keeps for this task id.
    return {"reply": reply, "model": MODEL_NAME, "attempt": ctx.attempt}


def register(app: App, *, queue: str | None = None) -> str:
    """Attach the demo handler to ``app`` on ``queue`` (default ``$DEMO_QUEUE``); returns it.

    Tests call this on their own App so the queue name is unique and cleaned up.
    """
    name = queue or os.environ.get("DEMO_QUEUE") or DEFAULT_QUEUE
    app.handler(name, retry=DEMO_RETRY)(answer)
    return name


def create_app(*, queue: str | None = None) -> App:
    """A fresh demo App with settings from the environment (``WECLAW_MQ_*``)."""
    demo = App("demo")
    register(demo, queue=queue)
    return demo


# What the CLI loads as 'consumers.demo:app'. Building it touches no network.
app = create_app()
QUEUE = next(iter(app.handlers))

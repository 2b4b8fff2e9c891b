"""The demo worker: an AI-reply handler on queue ``ai-tasks`` that calls a stand-in LLM.

The stand-in model streams its reply word by word with ``ctx.emit``, as a real model's
tokens would be: any process can read them live with ``app.stream(task_id)``, and a task
published with a session id also lands in that session's inbox (``app.inbox``). A run that
follows a crash or a failure (its worker killed with ``kill -9`` mid-reply, a simulated
outage) reads what the earlier run streamed (``ctx.emitted()``) and continues the reply
from there: readers see the rest appended, no word twice, none missing.

Run it with ``weclaw-mq worker consumers.demo:app --concurrency 4``; ``make demo`` does that
for you and publishes a few prompts (see ``consumers.demo_run``).

Environment (read on every call, so a test can change it without re-importing):

- ``DEMO_QUEUE`` (read at import): the queue name, default ``ai-tasks``.
- ``DEMO_LLM_LATENCY_S``: how long the stand-in model thinks before its first word, default 0.2.
- ``DEMO_LLM_WORD_S``: how long it takes per word after that, default 0.04.
- ``DEMO_LLM_FAILURE_RATE``: the chance that a call fails half-way through its reply,
  default 0.2, so retries show (and the retry continues the text the failed run streamed).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from collections.abc import Awaitable, Callable
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
    return (
        f'(stand-in reply) You asked "{prompt}". A real model would answer here one token '
        "at a time; this stand-in streams its words the same way, so you can watch them "
        "arrive, and see the run after a crash continue where the dead one stopped."
    )


def words_of(reply: str) -> list[str]:
    """The pieces the stand-in model streams: each word with the space after it, so the
    pieces joined are exactly the reply."""
    return re.findall(r"\S+\s*", reply)


async def stand_in_llm(
    prompt: str, emit: Callable[[str], Awaitable[None]], *, prefix: str = ""
) -> str:
    """Streams through ``emit`` the words of the reply that follow ``prefix`` (what an
    earlier run already streamed, as a real model continues an assistant prefix); returns
    the whole text. Takes ``DEMO_LLM_LATENCY_S`` plus ``DEMO_LLM_WORD_S`` per word, and
    fails half-way through the reply with probability ``DEMO_LLM_FAILURE_RATE``."""
    latency_s = _env_float("DEMO_LLM_LATENCY_S", 0.2)
    word_s = _env_float("DEMO_LLM_WORD_S", 0.04)
    failure_rate = _env_float("DEMO_LLM_FAILURE_RATE", 0.2)
    words = words_of(reply_to(prompt))
    # The prefix is whole words of this reply (chunks are words), so it says where to go on.
    start = len(words_of(prefix))
    fail_at = len(words) // 2 if random.random() < failure_rate else None
    await asyncio.sleep(latency_s)
    for i in range(start, len(words)):
        if i == fail_at:
            raise StandInLLMError("stand-in model overloaded (simulated)")
        await emit(words[i])
        await asyncio.sleep(word_s)
    return prefix + "".join(words[start:])


# --8<-- [start:continue]
async def answer(task: Prompt, ctx: Context) -> dict[str, Any]:
    # What an earlier run of this task streamed before it died or failed ("" on a first run).
    # Read before the first emit, it makes this run continue the stream, not start it over.
    before = "".join(str(chunk) for chunk in await ctx.emitted())
    continued = len(words_of(before))
    if continued:
        ctx.logger.info("continuing the reply after the %d words streamed before", continued)
    ctx.logger.info("calling %s for user %s", MODEL_NAME, task.user_id or "-")
    reply = await stand_in_llm(task.text, ctx.emit, prefix=before)
    # The return value is what the result store keeps for this task id.
    return {
        "reply": reply,
        "model": MODEL_NAME,
        "attempt": ctx.attempt,
        # How many words of the reply an earlier run had streamed (0: this run wrote it all).
        "continued_after_words": continued,
    }
    # --8<-- [end:continue]


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

"""Step 4 of the tutorial (docs/tutorial/04-streaming.md includes this file as it is): a
handler that streams its reply with ctx.emit while it writes it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from pydantic import BaseModel

from weclaw_mq import App, Context

# The tests set TUTORIAL_QUEUE to run this file on a queue of their own.
QUEUE = os.environ.get("TUTORIAL_QUEUE", "ai-stream")

app = App("stream-handler")


class Prompt(BaseModel):
    text: str


async def model_tokens(text: str) -> AsyncIterator[str]:  # a real client yields its tokens
    for word in f"echo: {text}".split(" "):
        await asyncio.sleep(0.05)  # the model thinking
        yield word + " "


@app.handler(QUEUE)
async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
    parts: list[str] = []
    async for token in model_tokens(task.text):
        await ctx.emit(token)  # to every app.stream(task_id) reader, in any process
        parts.append(token)
    return {"reply": "".join(parts).rstrip()}  # stored after every chunk is written

"""docs/how-to/limits.md shows the section of this file.

``app``, ``Prompt``, ``Chunk``, ``call_model`` and ``embed_text`` are the page's context; here
``call_model`` takes 0.2 s and counts how many of its calls run at once per user
(``RUNNING``, ``PEAK``). tests/integration/test_docs_howto_examples.py publishes six prompts of
one user to a worker of concurrency 6 on the real broker and Redis: two at most run at once.
"""

import asyncio
from collections import Counter

from pydantic import BaseModel

from weclaw_mq import App, Context

# isort: split
# --8<-- [start:import]
from weclaw_mq import Limit

# --8<-- [end:import]

app = App("assistant")
RUNNING: Counter[str] = Counter()  # calls of call_model running now, per user
PEAK: Counter[str] = Counter()  # the most that ever ran at once, per user


class Prompt(BaseModel):
    text: str
    user_id: str | None = None


class Chunk(BaseModel):
    text: str
    user_id: str | None = None


async def call_model(task: Prompt) -> str:
    user = task.user_id or ""
    RUNNING[user] += 1
    PEAK[user] = max(PEAK[user], RUNNING[user])
    try:
        await asyncio.sleep(0.2)
        return f"echo: {task.text}"
    finally:
        RUNNING[user] -= 1


async def embed_text(text: str) -> list[float]:
    return [float(len(text))]


# --8<-- [start:handlers]
@app.handler("ai-replies", limit=Limit(key=lambda task: task.user_id, concurrency=2))
async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
    return {"reply": await call_model(task)}


@app.handler(
    "embeddings",
    limit=[
        Limit(key=lambda task: task.user_id, rate=5, per_s=1.0),  # 5 starts a second per user
        Limit(rate=100, per_s=60.0),  # and 100 a minute for the whole handler
    ],
)
async def embed(task: Chunk) -> list[float]:
    return await embed_text(task.text)
    # --8<-- [end:handlers]

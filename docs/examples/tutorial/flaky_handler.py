"""Step 3 of the tutorial (docs/tutorial/03-retries.md includes this file as it is): a
handler whose model call fails until MODEL_API_KEY is set, so its task is retried, lands in
the DLQ, and is requeued once the cause is fixed."""

from __future__ import annotations

import os

from pydantic import BaseModel

from weclaw_mq import App, RetryPolicy

# The tests set TUTORIAL_QUEUE to run this file on a queue of their own.
QUEUE = os.environ.get("TUTORIAL_QUEUE", "ai-flaky")

app = App("flaky-handler")


class Prompt(BaseModel):
    text: str


class ModelUnavailable(Exception):
    """What a model client raises for a 401, a 429 or a 503."""


async def call_model(text: str) -> str:
    if not os.environ.get("MODEL_API_KEY"):  # read on every call: the fix needs a restart only
        raise ModelUnavailable("401 from the model: MODEL_API_KEY is not set")
    return f"echo: {text}"


# Short delays, to watch them go by: 1 s, then 2 s, then the DLQ (production: 5 s, 10 s, 20 s).
@app.handler(QUEUE, retry=RetryPolicy(max_retries=2, delay_s=1, multiplier=2))
async def reply(task: Prompt) -> dict[str, str]:
    return {"reply": await call_model(task.text)}

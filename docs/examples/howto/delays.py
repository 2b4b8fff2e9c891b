"""docs/how-to/delays.md shows the section of this file: a handler that retries when a
rate-limited API says (``Retry-After``), and a delayed publish.

``app``, ``Prompt``, ``client`` and ``MODEL_URL`` are the page's context: an App, the task's
model, an HTTP client and the model API's address (``MODEL_URL`` in the environment).
tests/integration/test_docs_howto_examples.py points ``MODEL_URL`` at a real HTTP server
that answers one 429 with ``Retry-After: 2``, and checks on the real broker and Redis when
the retry and the delayed task run.
"""

import os

import httpx
from pydantic import BaseModel

from weclaw_mq import App, Context

# isort: split
# --8<-- [start:example]
from weclaw_mq import Retry, retry_after_s

# --8<-- [end:example]

MODEL_URL = os.environ.get("MODEL_URL", "http://127.0.0.1:8000/v1/complete")
client = httpx.AsyncClient(timeout=30)
app = App("assistant")


class Prompt(BaseModel):
    text: str


# --8<-- [start:handler]
@app.handler("ai-replies")
async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
    response = await client.post(MODEL_URL, json={"prompt": task.text})
    if response.status_code == 429:
        # Seconds or an HTTP date; absent or unreadable: None, i.e. the policy's delay.
        after = retry_after_s(response.headers.get("Retry-After"))
        raise Retry("rate limited", after_s=after)
    return {"reply": response.json()["text"]}


async def later() -> str:
    # Also publish_many and ctx.publish take delay_s.
    return await app.publish("ai-replies", Prompt(text="later"), delay_s=2)
    # --8<-- [end:handler]

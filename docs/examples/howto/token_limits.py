"""docs/how-to/limits.md shows the section of this file: a token limit per model, with the
estimate at admission, the usage reported by the run and a 429's Retry-After.

``PROVIDER_URL`` is a model provider's base URL; tests/integration/test_docs_howto_examples.py
points it at a local stand-in that enforces its own token limits, publishes tasks to a worker
of ``app`` on the real broker and Redis, and checks that none met a 429.
"""

import os

import httpx
from pydantic import BaseModel

from weclaw_mq import App, Context, Limit, Retry, retry_after_s

app = App("answers")
client = httpx.AsyncClient(base_url=os.environ.get("PROVIDER_URL", "http://127.0.0.1:8080"))


# --8<-- [start:handler]
class Question(BaseModel):
    model: str
    prompt: str
    max_tokens: int = 256


@app.handler(
    "answers",
    limit=Limit(
        key=lambda task: task.model,  # one budget per model (a list of limits: per tenant too)
        tokens=90_000,  # tokens per window, as the provider's TPM
        rate=500,  # and its RPM
        per_s=60,
        estimate=lambda task: len(task.prompt) // 4 + task.max_tokens,
    ),
)
async def answer(task: Question, ctx: Context) -> str:
    response = await client.post("/v1/complete", json=task.model_dump())
    if response.status_code == 429:
        raise Retry("rate limited", after_s=retry_after_s(response.headers.get("Retry-After")))
    response.raise_for_status()
    reply = response.json()
    usage = reply["usage"]
    ctx.usage(input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"])
    return str(reply["text"])
    # --8<-- [end:handler]

"""docs/how-to/fallbacks.md shows the section of this file: a handler whose attempts go down a
list of models, each up or down for every worker at once.

``PROVIDER_URL`` is a model provider's base URL; tests/integration/test_docs_howto_examples.py
points it at a local stand-in, takes the first model down, and checks that the task's retry
went to the second.
"""

import os

import httpx

from weclaw_mq import App, Context, Retry, UpstreamDown, retry_after_s
from weclaw_mq.llm import Fallback

app = App("answers")
client = httpx.AsyncClient(base_url=os.environ.get("PROVIDER_URL", "http://127.0.0.1:8080"))


# --8<-- [start:handler]
@app.handler("answers", fallback=Fallback(["big-1", "big-2", "small-1"], cool_down_s=30))
async def answer(task: dict[str, str], ctx: Context) -> str:
    body = {"model": ctx.model, "prompt": task["prompt"], "max_tokens": 64}
    response = await client.post("/v1/complete", json=body)
    if response.status_code == 429:  # this model is down for its Retry-After, for everyone
        raise Retry("rate limited", after_s=retry_after_s(response.headers.get("Retry-After")))
    if response.status_code >= 500:  # counts towards taking this model down
        raise UpstreamDown(f"{ctx.model} answered {response.status_code}")
    return f"{ctx.model}: {response.json()['text'][:20]}"
    # --8<-- [end:handler]

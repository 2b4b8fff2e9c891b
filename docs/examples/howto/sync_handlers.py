"""docs/how-to/handlers.md shows the section of this file: a plain-``def`` handler around a
blocking SDK, run in the worker's threads.

tests/integration/test_docs_howto_examples.py runs a worker for ``app`` against the real broker
and Redis, and checks what the page says.
"""

# --8<-- [start:module]
import time

from pydantic import BaseModel

from weclaw_mq import App, Context, Reject

app = App("summaries")  # settings come from WECLAW_MQ_* environment variables


class Document(BaseModel):
    text: str


class BlockingSDK:  # a client that blocks: requests, boto3, an old vendor SDK
    def summarise(self, text: str, *, timeout: float) -> list[str]:
        time.sleep(0.05)  # the network round trip
        return [word.upper() for word in text.split()]


sdk = BlockingSDK()


@app.handler("doc-summaries", timeout_s=60)
def summarise(task: Document, ctx: Context) -> dict[str, str]:
    if not task.text.strip():
        raise Reject("empty document")  # signals, retries and timeouts work as in async def
    # A timeout of its own, under timeout_s: a call past timeout_s cannot be killed.
    words = sdk.summarise(task.text, timeout=50)
    for word in words:
        if ctx.cancelled:  # a cancel does not interrupt a thread: look between steps
            break  # what it returns after a cancel is dropped
        ctx.emit_sync(word)  # ctx.emit from the thread
    return {"summary": " ".join(words)}
    # --8<-- [end:module]

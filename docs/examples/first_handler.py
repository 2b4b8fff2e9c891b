"""The tutorial's first handler (docs/tutorial/index.md includes this file as it is).

tests/unit/test_docs_site.py runs it through weclaw_mq.testing, and
tests/integration/test_docs_tutorial.py with a worker on RabbitMQ and Redis, so the page shows
code that works.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from weclaw_mq import App, Context, Reject, RetryPolicy

# The tests set TUTORIAL_QUEUE to run this file on a queue of their own.
QUEUE = os.environ.get("TUTORIAL_QUEUE", "ai-replies")

app = App("first-handler")  # settings come from WECLAW_MQ_* environment variables


class Prompt(BaseModel):
    text: str


async def call_model(text: str) -> str:  # your model client goes here
    return f"echo: {text}"


@app.handler(
    QUEUE,
    retry=RetryPolicy(max_retries=3, delay_s=5, multiplier=2),  # 5 s, 10 s, 20 s, then the DLQ
    timeout_s=120,
)
async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
    if not task.text.strip():
        raise Reject("empty prompt")  # no retry can fix it: straight to ai-replies.dlq
    ctx.logger.info("attempt %d", ctx.attempt)  # the log line carries task id and trace id
    answer = await call_model(task.text)  # any exception: retried after the next delay
    return {"reply": answer}  # stored under the task id, then the message is acked

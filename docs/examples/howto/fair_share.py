"""docs/how-to/fair-share.md shows the section of this file: a handler whose tenants share its
workers in turn, so one tenant's backlog does not hold up another tenant's task.

tests/integration/test_docs_howto_examples.py queues a backlog of one tenant, then one task
of another, and checks that the second started long before the backlog ended.
"""

import asyncio

from pydantic import BaseModel

from weclaw_mq import App
from weclaw_mq.llm import Fair

app = App("answers")


class Question(BaseModel):
    tenant: str
    prompt: str


# --8<-- [start:handler]
@app.handler("answers", tenant=lambda task: task.tenant, fair=Fair(lanes=4))
async def answer(task: Question) -> str:
    await asyncio.sleep(0.05)  # stands for the model call
    return f"{task.tenant}: {task.prompt[:20]}"
    # --8<-- [end:handler]

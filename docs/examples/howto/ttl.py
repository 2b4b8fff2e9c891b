"""docs/how-to/ttl.md shows the section of this file.

``Prompt`` and the ``ai-replies`` handler are the page's context (see handlers.py).
tests/integration/test_docs_howto_examples.py reads the published tasks back from the real
broker (their lifetimes on the wire and in ``status()``), and sees an expired task in
``ai-replies.dlq`` with status ``expired``.
"""

from pydantic import BaseModel

from weclaw_mq import App

app = App("assistant")


class Prompt(BaseModel):
    text: str


class Report(BaseModel):
    week: str


@app.handler("ai-replies")
async def reply(task: Prompt) -> dict[str, str]:
    return {"reply": f"echo: {task.text}"}


# --8<-- [start:example]
async def ask(prompt: Prompt) -> str:
    return await app.publish("ai-replies", prompt, ttl_s=600)  # this task: 10 minutes


@app.handler("ai-reports", ttl_s=3 * 24 * 3600)  # tasks this App publishes without their own
async def report(task: Report) -> str:
    return f"the report of week {task.week}"
    # --8<-- [end:example]

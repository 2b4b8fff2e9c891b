"""docs/how-to/priorities.md shows the section of this file.

tests/integration/test_docs_howto_examples.py queues a backlog of NORMAL tasks, then runs
``send()``, and checks on the real broker that the URGENT task starts first.
"""

# --8<-- [start:example]
from weclaw_mq import App, Priority

app = App("assistant")


@app.handler("ai-replies", priorities=True, priority="high")  # the default of tasks without one
async def reply(task: dict[str, str]) -> dict[str, str]:
    return {"reply": "..."}


async def send() -> None:
    await app.publish("ai-replies", {"prompt": "hi"}, priority=Priority.URGENT)
    await app.publish_many("ai-replies", [{"prompt": "weekly report"}], priority="normal")
    # --8<-- [end:example]

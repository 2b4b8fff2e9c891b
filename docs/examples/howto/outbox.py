"""docs/how-to/outbox.md shows the section of this file: a publish that returns while the
broker is down, its task stored in the local outbox.

The ``summaries`` handler is the page's context (the worker side, not shown).
tests/integration/test_docs_howto_examples.py runs ``accept()`` with the broker on a closed
port (``stored_locally``), then opens the same outbox file with the broker up: the relay sends
the task and a worker runs it.
"""

from weclaw_mq import App, Settings, TaskState

# --8<-- [start:example]
app = App("api", settings=Settings(outbox_path="/var/lib/myapi/outbox.db"))
# --8<-- [end:example]


@app.handler("summaries")
async def summarise(doc: dict[str, str]) -> dict[str, str]:
    return {"summary": doc["text"][:20]}


async def accept() -> TaskState | None:
    # --8<-- [start:publish]
    task_id = await app.publish("summaries", {"text": "..."})  # broker down: still returns
    state = await app.status(task_id)  # TaskStatus.STORED_LOCALLY until the relay sent it
    # --8<-- [end:publish]
    return state

"""docs/how-to/streaming.md shows the section of this file.

tests/integration/test_docs_howto_examples.py publishes a prompt with a session id to a
worker on the real broker and Redis, and reads what ``watch()`` and ``deliver()`` print.
"""

# --8<-- [start:example]
from weclaw_mq import App, Context

app = App("chat")


@app.handler("chat")
async def chat(prompt: dict[str, str], ctx: Context) -> dict[str, str]:
    words = prompt["text"].split()
    for word in words:
        await ctx.emit(word)  # str or JSON data; returns at once
    return {"text": " ".join(words)}


async def watch(task_id: str, last_seen: str | None) -> None:
    async for event in app.stream(task_id, after=last_seen):
        print(event.id, event.kind, event.data)  # ends after the "final" event


async def deliver(session_id: str) -> None:
    inbox = app.inbox(session_id)
    async for event in inbox:  # pending oldest first, then live; never ends by itself
        print(event.task_id, event.kind, event.data or event.result)
        await inbox.confirm(event.id)  # removes it and everything before it
    # --8<-- [end:example]

"""docs/how-to/notifications.md shows the section of this file.

``app``, ``Prompt``, ``push_to_user`` and ``push_failure`` are the page's context: here the
two pushes keep what they were given in ``PUSHED``. tests/integration/test_docs_howto_examples.py
publishes a prompt that succeeds and one that is rejected, and sees both notifications arrive
through ``ai-replies.results`` on the real broker.
"""

from typing import Any

from pydantic import BaseModel

from weclaw_mq import App, Context, Reject

# isort: split
# --8<-- [start:import]
from weclaw_mq import TaskNotification, TaskStatus

# --8<-- [end:import]

app = App("assistant")
PUSHED: list[tuple[str, str, Any]] = []  # (task id, "result" or "failure", what was pushed)


class Prompt(BaseModel):
    text: str


async def push_to_user(task_id: str, result: Any) -> None:
    PUSHED.append((task_id, "result", result))


async def push_failure(task_id: str, reason: str | None, error: str | None) -> None:
    PUSHED.append((task_id, "failure", (reason, error)))


# --8<-- [start:handlers]
@app.handler("ai-replies", notify=True)  # announces to "ai-replies.results"
async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
    if not task.text.strip():
        raise Reject("empty prompt")
    return {"reply": f"echo: {task.text}"}


@app.handler("ai-replies.results")  # the notification service: just another handler
async def tell_the_user(note: TaskNotification, ctx: Context) -> None:
    if note.status is TaskStatus.SUCCEEDED:
        await push_to_user(note.task_id, note.result)
    else:
        await push_failure(note.task_id, note.reason, note.error)
    # --8<-- [end:handlers]

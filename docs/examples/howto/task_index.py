"""docs/reference/task-store.md shows the section of this file: a page of a queue's
dead-lettered tasks, newest first, the page after it, and the timeline of the newest.

The ``ai-replies`` handler is the page's context: it refuses every task.
tests/integration/test_docs_howto_examples.py dead-letters two tasks on the real broker and
Redis and checks what ``triage`` prints.
"""

from weclaw_mq import App, Reject, TaskQuery, TaskStatus

app = App("console")


@app.handler("ai-replies")
async def reply(prompt: dict[str, str]) -> str:
    raise Reject(f"no model named {prompt['model']!r}")


async def triage() -> None:
    # --8<-- [start:example]
    query = TaskQuery(queue="ai-replies", status=TaskStatus.DEAD_LETTERED, limit=1)
    page = await app.tasks(query)
    for task in page.tasks:  # newest first, with each task's record as it is now
        print(task.task_id, task.indexed_at, task.state.reason if task.state else "expired")
    if page.next_cursor is not None:  # the next page starts where this one stopped
        older = await app.tasks(TaskQuery(**{**vars(query), "cursor": page.next_cursor}))
        print(f"and {len(older.tasks)} older")
    for event in await app.timeline(page.tasks[0].task_id):  # what happened, oldest first
        print(event.at, event.status, event.attempt, event.error or event.reason or "")
    # --8<-- [end:example]

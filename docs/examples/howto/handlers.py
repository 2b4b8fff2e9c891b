"""docs/how-to/handlers.md shows the sections of this file: the module ``mymodule.py`` of the
page, and publishing from a coroutine that holds the App.

tests/integration/test_docs_howto_examples.py runs a worker for ``app`` and ``main()`` against
the real broker and Redis, and checks what the page says.
"""

# --8<-- [start:module]
from pydantic import BaseModel

from weclaw_mq import App, Context, Reject, RetryPolicy

app = App("replies")  # settings come from WECLAW_MQ_* environment variables


class Prompt(BaseModel):
    text: str
    user_id: str | None = None


async def call_model(text: str) -> str:  # your model client goes here
    return f"echo: {text}"


@app.handler(
    "ai-replies",
    retry=RetryPolicy(max_retries=3, delay_s=5, multiplier=2),  # 5 s, 10 s, 20 s, then the DLQ
    timeout_s=120,
)
async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
    if not task.text.strip():
        raise Reject("empty prompt")  # no retry can fix it: straight to ai-replies.dlq
    ctx.logger.info("attempt %d", ctx.attempt)  # the line carries task id and trace id
    answer = await call_model(task.text)  # any exception: retried after the next delay
    return {"reply": answer}  # stored under the task id, then the message is acked
    # --8<-- [end:module]


# --8<-- [start:publish]
async def main() -> None:
    async with app:
        task_id = await app.publish("ai-replies", Prompt(text="Write a haiku"))  # confirmed
        state = await app.status(task_id)  # TaskState or None: queued, running, retrying, ...
        print(task_id, state.status if state else "no record yet")
        final = await app.result(task_id, timeout_s=120)  # succeeded, dead_lettered, ...
        print(task_id, final.status, final.result)
        # A task id that several queues share (pipeline stages) has one record per queue:
        # app.result(task_id, queue="ai-review", timeout_s=120) waits for that queue's.
        # --8<-- [end:publish]

"""docs/how-to/cancel.md shows the section of this file.

The ``generate`` handler is the page's context: it streams a long answer, slowly.
tests/integration/test_docs_howto_examples.py cancels a running task on the real broker and
Redis (changed, the handler stopped, status ``cancelled``), then the same task again (too
late: it already ended).
"""

import asyncio

from weclaw_mq import App, Cancellation, Context

app = App("assistant")


@app.handler("generate")
async def generate(prompt: dict[str, str], ctx: Context) -> str:
    for word in prompt["text"].split():
        await ctx.emit(word)
        await asyncio.sleep(1)  # a long answer: a "stop generating" button has time
    return prompt["text"]


async def stop_generating(task_id: str) -> Cancellation:
    # --8<-- [start:example]
    answer = await app.cancel(task_id)  # or app.cancel(task_id, queue="generate")
    if not answer.changed and answer.state is not None:
        print(f"too late: it already ended ({answer.state.status})")
    # --8<-- [end:example]
    return answer

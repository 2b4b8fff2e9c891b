from __future__ import annotations

from pydantic import BaseModel

from tests.conftest import wait_until
from weclaw_mq import Context


class Prompt(BaseModel):
    text: str


async def test_published_task_is_handled_and_acked(make_app, start_worker, qname):
    app = make_app()
    seen: list[tuple[str, str]] = []

    @app.handler(qname)
    async def reply(task: Prompt, ctx: Context) -> dict[str, str]:
        seen.append((task.text, ctx.task_id))
        return {"reply": task.text.upper()}

    await start_worker(app)
    task_id = await app.publish(qname, Prompt(text="hello"))
    await wait_until(lambda: seen, what="the handler to run")
    assert seen == [("hello", task_id)]

"""docs/how-to/costs.md shows the section of this file: prices per model, a tenant per task,
a daily cap that moves a tenant to a cheaper model, and the usage each call reports.

``call_model`` stands in for a model client: it answers with the tokens it charged (its
prompt's length / 4, and 20 for the answer). tests/integration/test_docs_howto_examples.py
runs a worker for ``app`` on the real broker and Redis and reads the costs back.
"""

from dataclasses import dataclass


@dataclass
class Reply:
    text: str
    input_tokens: int
    output_tokens: int


async def call_model(model: str, prompt: str) -> Reply:
    return Reply(f"{model} says hi", max(1, len(prompt) // 4), 20)


# --8<-- [start:module]
from weclaw_mq import App, Context  # noqa: E402
from weclaw_mq.llm import Cap, Price  # noqa: E402

app = App(
    "answers",
    prices={
        "big-1": Price(input_per_1k=0.5, output_per_1k=1.5),
        "small-1": Price(input_per_1k=0.05, output_per_1k=0.15),
    },
)


@app.handler(
    "answers",
    tenant=lambda task: task["tenant"],  # whose bill: a str or int from the task
    cap=Cap(per_day=20.0, action="downgrade", model="small-1"),
)
async def answer(task: dict[str, str], ctx: Context) -> str:
    model = ctx.model or task["model"]  # ctx.model: the cap's cheaper model, when downgraded
    reply = await call_model(model, task["prompt"])
    ctx.usage(input_tokens=reply.input_tokens, output_tokens=reply.output_tokens, model=model)
    return reply.text
    # --8<-- [end:module]

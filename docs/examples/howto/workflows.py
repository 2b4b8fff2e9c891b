"""docs/how-to/workflows.md shows the sections of this file.

A chain (understand -> lookup -> generate) and a group (summarise each chunk, then merge).
tests/integration/test_docs_howto_examples.py runs both on the real broker and Redis: the
chain's result is the last stage's, the merge runs once with the summaries in order.
"""

from typing import Any

from weclaw_mq import App, Context, TaskState
from weclaw_mq.workflows import PartResult, Stage

app = App("assistant")


# --8<-- [start:chain]
@app.handler("understand")
async def understand(question: str, ctx: Context) -> dict[str, str]:
    return {"question": question, "topic": question.split()[-1].strip("?")}


@app.handler("lookup")
async def lookup(intent: dict[str, str], ctx: Context) -> dict[str, Any]:
    return {**intent, "facts": [f"{intent['topic']} is a star"]}


@app.handler("generate", priority="high", priorities=True)
async def generate(found: dict[str, Any], ctx: Context) -> str:
    return f"{found['question']} {' '.join(found['facts'])}."


async def answer(question: str) -> TaskState:
    chain_id = await app.chain(
        ["understand", "lookup", Stage("generate", priority="high")],
        question,
        session_id="user-42",  # every stage's chunks and final reach this inbox
        deadline_s=300,  # not ended by then: "expired", naming the stage it waited for
    )
    return await app.result(chain_id)  # the chain's outcome, one thing to await
    # --8<-- [end:chain]


# --8<-- [start:group]
@app.handler("summarise")
async def summarise(chunk: str, ctx: Context) -> str:
    return chunk[:20]


@app.handler("merge")
async def merge(summaries: list[str], ctx: Context) -> str:
    return " / ".join(summaries)  # in the chunks' order, once all of them ended


async def summary(chunks: list[str]) -> TaskState:
    group_id = await app.group("summarise", chunks, then="merge", deadline_s=600)
    return await app.result(group_id)  # the merge's result, or why the group failed
    # --8<-- [end:group]


# --8<-- [start:pass]
@app.handler("merge-what-came")
async def merge_what_came(parts: list[PartResult], ctx: Context) -> dict[str, Any]:
    done = [p.result for p in parts if p.status == "succeeded"]
    return {"summary": " / ".join(done), "missing": [p.task_id for p in parts if p.result is None]}


async def summary_despite_failures(chunks: list[str]) -> TaskState:
    group_id = await app.group("summarise", chunks, then="merge-what-came", on_failure="pass")
    return await app.result(group_id)
    # --8<-- [end:pass]

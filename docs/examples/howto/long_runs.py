"""docs/how-to/long-runs.md shows a section of this file: an agent run of many steps, marked
``long_running`` so it may outlive the broker's consumer timeout and be resumed elsewhere.

``make_plan`` and ``do`` stand in for a model and a tool; each counts its real calls in
``CALLS``, so that tests/integration/test_docs_howto_examples.py can stop the worker running it
mid-run (a SIGTERM's hand-over) and show another worker resume it, the steps recorded before
the stop replayed instead of called again.
"""

import asyncio

CALLS: list[str] = []
STEP_S = 0.2


async def make_plan(goal: str) -> list[str]:
    CALLS.append("plan")
    return [f"{goal}, part {i}" for i in range(1, 9)]


async def do(item: str) -> str:
    CALLS.append(item)
    await asyncio.sleep(STEP_S)  # a tool or model call that takes a while
    return item.upper()


# --8<-- [start:agent]
from weclaw_mq import App, Context  # noqa: E402

app = App("agents")


@app.handler("agent.run", long_running=True, timeout_s=4 * 3600)
async def run(task: dict[str, str], ctx: Context) -> list[str]:
    plan = await ctx.step("plan", make_plan, task["goal"])  # memoized: a resumed run replays it
    return [await ctx.step("do", do, item) for item in plan]


# --8<-- [end:agent]

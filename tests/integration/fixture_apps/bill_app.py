"""A worker app whose handler calls the local stand-in for a provider
(``weclaw_mq.testing.fake_provider``) as an agent would, in an App with prices: its calls are
billed by the provider per task and costed in the App's ledger, so a test can kill the worker
with SIGKILL mid-run and compare the two.

Run as ``weclaw-mq worker tests.integration.fixture_apps.bill_app:app`` with cwd at the
repository root.

Two kinds of task (``BillJob.calls`` or ``BillJob.tokens``):
- an agent: ``calls`` model calls, each a step (``ctx.step("call", ...)``) that reports its
  usage: a re-run replays the recorded calls and calls only the rest;
- a streamed generation of ``tokens`` tokens, each emitted (``ctx.emit``) as it comes: a re-run
  continues from what the stream holds (``ctx.emitted()`` as the provider's prefix).

Environment:
    BILL_APP_NAME      the App's name (its cost ledger's totals)
    BILL_APP_QUEUE     the handler's queue
    BILL_APP_PROVIDER  the provider's base URL
The ``WECLAW_MQ_*`` settings apply as in any app.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from pydantic import BaseModel

from tests.integration.fixture_apps import lazy_app, required_env
from weclaw_mq import App, Context, Settings
from weclaw_mq.llm import Price

MODEL = "bill-model"
PRICES = {MODEL: Price(input_per_1k=0.5, output_per_1k=1.5)}
# An agent's call: a prompt of ~60 tokens, an answer of 25.
CALL_OUTPUT_TOKENS = 25


class BillJob(BaseModel):
    calls: int = 0  # an agent of this many model calls, each a step
    tokens: int = 0  # a streamed generation of this many tokens


def build_app(name: str, queue: str, *, settings: Settings, provider_url: str) -> App:
    app = App(name, settings=settings, prices=dict(PRICES))

    async def call_model(ctx: Context, client: httpx.AsyncClient, n: int) -> str:
        body = {
            "model": MODEL,
            "prompt": f"step {n} of the plan: " + "context " * 28,
            "max_tokens": CALL_OUTPUT_TOKENS,
            "task": ctx.task_id,
        }
        response = await client.post("/v1/complete", json=body)
        response.raise_for_status()
        answer = response.json()
        usage = answer["usage"]
        ctx.usage(input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"])
        return str(answer["text"])[:8]

    @app.handler(queue)
    async def run(task: BillJob, ctx: Context) -> Any:
        async with httpx.AsyncClient(base_url=provider_url, timeout=30) as client:
            if task.tokens:
                return await _generate(task, ctx, client)
            answers = [
                await ctx.step("call", call_model, ctx, client, n) for n in range(task.calls)
            ]
            return {"calls": len(answers), "attempt": ctx.attempt}

    async def _generate(task: BillJob, ctx: Context, client: httpx.AsyncClient) -> Any:
        # What an earlier run streamed before it died: the model goes on from there.
        prefix = "".join(await ctx.emitted())
        body = {
            "model": MODEL,
            "prompt": "write the report",
            "max_tokens": task.tokens,
            "task": ctx.task_id,
            "prefix": prefix,
        }
        text = prefix
        async with client.stream("POST", "/v1/stream", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                data = json.loads(line)
                if "text" in data:
                    await ctx.emit(data["text"])
                    text += data["text"]
                else:
                    usage = data["usage"]
                    ctx.usage(
                        input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"]
                    )
        return {"chars": len(text), "continued_from": len(prefix), "attempt": ctx.attempt}

    return app


def _app_from_env() -> App:
    name, queue, url = required_env(
        __name__, "BILL_APP_NAME", "BILL_APP_QUEUE", "BILL_APP_PROVIDER"
    )
    return build_app(name, queue, settings=Settings(), provider_url=url)


# Built on first access rather than at import, so tests can import build_app without the
# worker's environment.
__getattr__ = lazy_app(__name__, _app_from_env)

"""docs/how-to/admission.md shows the sections of this file: the team's own admission rule (an
hourly quota per customer) on the same seam as the library's limits, caps and fallbacks, and a
middleware around the handler's call.

tests/integration/test_docs_howto_examples.py runs a worker for ``app`` against the real
broker and Redis, and checks what the page says.
"""

# --8<-- [start:quota]
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import redis.asyncio as redis

from weclaw_mq import App, Context, Defer, Middleware, Reject, Run


class HourlyQuota(Middleware):
    """At most ``per_hour`` runs an hour for each customer of ``queue``: the rest wait for the
    next hour without spending an attempt. A task of a customer the contract does not name
    goes to the dead-letter queue."""

    def __init__(self, queue: str, per_hour: int, customers: set[str], redis_url: str) -> None:
        self.queue, self.per_hour, self.customers = queue, per_hour, customers
        self.redis = redis.Redis.from_url(redis_url)

    async def admit(self, run: Run) -> Defer | None:
        if run.queue != self.queue:
            return None
        customer = run.task["customer"]
        if customer not in self.customers:
            raise Reject(f"customer {customer!r} has no contract")  # to the DLQ, now
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        key = f"quota:{self.queue}:{customer}:{hour:%Y%m%d%H}"
        # A task counts once, however often it is admitted (a retry, a redelivery).
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(key, run.task_id)
            pipe.scard(key)
            pipe.expire(key, 7200)
            added, runs, _ = await pipe.execute()
        if added and runs > self.per_hour:
            await self.redis.srem(key, run.task_id)
            why = f"customer {customer!r} used its {self.per_hour} runs this hour"
            return Defer(why, until=hour + timedelta(hours=1), by="quota")
        return None


# --8<-- [end:quota]


# --8<-- [start:around]
class Labelled(Middleware):
    """Around the handler's call, under its deadline: the run's model calls on its result."""

    async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
        result = await call()
        calls = [(u.model, u.input_tokens, u.output_tokens) for u in run.usage]
        return {"answer": result, "calls": calls}


# --8<-- [end:around]


# --8<-- [start:app]
app = App("answers")
quota = HourlyQuota("questions", 2, {"acme", "globex"}, app.settings.redis_url.get_secret_value())
app.add_middleware(quota)
app.add_middleware(Labelled())


@app.handler("questions")
async def answer(task: dict[str, str], ctx: Context) -> str:
    ctx.usage(input_tokens=12, output_tokens=3, model="small")
    return f"hello, {task['customer']}"


# --8<-- [end:app]

"""The cost ledger: every model call a handler reports (``ctx.usage``), on its task and in
its app's daily totals per tenant and per model, in Redis.

A task's calls are a list beside its records (its hash tag), kept as long as its records
(``result_ttl_s``): every attempt's, retries and downgrades included. A day's totals are one
hash per app and UTC day (``contract.naming.costs_key``), kept ``cost_days_kept`` days: costs
in millionths of the price table's currency (integers: sums are exact) and tokens, per
tenant and per model, and cost and runs per queue (a cap's estimate of one run). A call made
inside a step (``ctx.step``) is recorded as the step's record is written, before it; any
other call after its attempt ends; each with one pipelined round trip (``llm.calls``). So
each call whose answer reached the worker is counted once, a worker killed mid-run included,
and a replayed step counts nothing.

redis-py is not imported here: an app without prices never loads it (``ledger_of``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

from weclaw_mq.contract.naming import costs_key, usage_key
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.state.outages import answered, redis_store

if TYPE_CHECKING:
    from weclaw_mq.state.redis_clients import StateClient

# Costs are kept as integers of this many units per currency unit: sums stay exact.
MICROS = 1_000_000
# The tenant of a task whose handler names none.
NO_TENANT = "-"


@dataclass(frozen=True)
class Call:
    """One model call of one attempt, as recorded."""

    queue: str
    attempt: int
    model: str
    tenant: str
    input_tokens: int
    output_tokens: int
    cost_micros: int
    at: str  # ISO 8601, the worker's clock

    @property
    def cost(self) -> float:
        return self.cost_micros / MICROS


@dataclass(frozen=True)
class Totals:
    """Cost and tokens of one tenant or one model over some days."""

    name: str
    cost_micros: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def cost(self) -> float:
        return self.cost_micros / MICROS


def day_of(moment: datetime) -> str:
    return moment.astimezone(UTC).date().isoformat()


class CostLedger:
    """One app's ledger in one Redis (or Cluster).

    Args:
        client: The redis-py client.
        app: The app's name: its totals are its own.
        usage_ttl_s: How long a task's calls are kept (its records' ``result_ttl_s``).
        days_kept: How many days a day's totals are kept.
    """

    def __init__(
        self, client: StateClient, app: str, *, usage_ttl_s: float, days_kept: int
    ) -> None:
        self._client = client
        self.app = app
        self._usage_ttl_s = max(1, int(usage_ttl_s))
        self._days_ttl_s = days_kept * 86_400 + 86_400

    async def record(
        self, task_id: str, calls: Sequence[Call], *, run_of: str | None = None
    ) -> None:
        """Add ``calls`` to the task's list and to their day's totals: one round trip per
        slot, both in flight at once.

        Args:
            task_id: The task whose calls they are.
            calls: The calls, costed.
            run_of: The queue whose attempt ended with these calls (its day's runs count one
                more); None for calls billed mid-run (a step's), which count no run.
        """
        writes = []
        if calls:
            task = self._client.pipeline(transaction=False)
            key = usage_key(task_id)
            for call in calls:
                task.rpush(key, json.dumps(call.__dict__, separators=(",", ":")))
            task.expire(key, self._usage_ttl_s)
            writes.append(task)
        totals = self._client.pipeline(transaction=False)
        for call in calls:
            day = costs_key(self.app, call.at[:10])
            for who in (f"tenant:{call.tenant}", f"model:{call.model}"):
                totals.hincrby(day, f"{who}:cost", call.cost_micros)
                totals.hincrby(day, f"{who}:in", call.input_tokens)
                totals.hincrby(day, f"{who}:out", call.output_tokens)
            totals.hincrby(day, f"queue:{call.queue}:cost", call.cost_micros)
            totals.expire(day, self._days_ttl_s)
        if run_of is not None:
            # One run per attempt that reported calls: what a run of the queue costs on
            # average (its steps' calls billed earlier included).
            day = costs_key(self.app, calls[0].at[:10] if calls else day_of(datetime.now(UTC)))
            totals.hincrby(day, f"queue:{run_of}:runs", 1)
            totals.expire(day, self._days_ttl_s)
        if len(totals):
            writes.append(totals)
        await asyncio.gather(*(answered(pipe.execute()) for pipe in writes))

    async def calls_of(self, task_id: str) -> list[Call]:
        """Every model call recorded on the task, oldest first."""
        raw = await answered(self._client.lrange(usage_key(task_id), 0, -1))
        return [Call(**json.loads(item)) for item in raw]

    async def spent_micros(self, tenant: str, day: str) -> int:
        """What ``tenant`` spent on UTC day ``day``, in millionths."""
        value = await answered(self._client.hget(costs_key(self.app, day), f"tenant:{tenant}:cost"))
        return int(value) if value is not None else 0

    async def cap_reading(self, tenant: str, queue: str, day: str) -> tuple[int, int | None]:
        """What ``tenant`` spent on UTC day ``day``, and what a run of ``queue`` cost on
        average that day (None before one was recorded), both in millionths."""
        spent, cost, runs = await answered(
            self._client.hmget(
                costs_key(self.app, day),
                [f"tenant:{tenant}:cost", f"queue:{queue}:cost", f"queue:{queue}:runs"],
            )
        )
        mean = int(cost or 0) // int(runs) if runs is not None and int(runs) > 0 else None
        return int(spent or 0), mean

    async def totals(self, days: int, *, by: str, today: date | None = None) -> list[Totals]:
        """Totals per tenant or per model (``by``) over the last ``days`` UTC days, the most
        expensive first."""
        if by not in ("tenant", "model"):
            raise ConfigurationError(f"costs are summed by tenant or by model, not {by!r}")
        last = today or datetime.now(UTC).date()
        pipe = self._client.pipeline(transaction=False)
        for back in range(days):
            pipe.hgetall(costs_key(self.app, (last - timedelta(days=back)).isoformat()))
        sums: dict[str, dict[str, int]] = {}
        for fields in await answered(pipe.execute()):
            for raw_field, raw_value in fields.items():
                field = _text(raw_field)
                kind, _, rest = field.partition(":")
                if kind != by:
                    continue
                name, _, measure = rest.rpartition(":")
                sums.setdefault(name, {}).setdefault(measure, 0)
                sums[name][measure] += int(_text(raw_value))
        totals = [
            Totals(name, m.get("cost", 0), m.get("in", 0), m.get("out", 0))
            for name, m in sums.items()
        ]
        return sorted(totals, key=lambda t: (-t.cost_micros, t.name))


def ledger_of(store: object, app: str, *, usage_ttl_s: float, days_kept: int) -> CostLedger:
    """The cost ledger in ``store``'s Redis.

    Raises:
        ConfigurationError: ``store`` is not the Redis task store.
    """
    found = redis_store(store, "costs are kept")
    ledger: CostLedger = found.cost_ledger(app, usage_ttl_s=usage_ttl_s, days_kept=days_kept)
    return ledger


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

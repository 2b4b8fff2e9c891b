"""The fair book's model test (``tests/fair_book_model.py``) against the Redis book: the
scripts keep the rules the memory book is checked for, under stale counts, overlapping
workers and producers answering in any order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.fair_book_model import TENANTS, FairBookModel
from weclaw_mq.contract.naming import fair_flying_key, fair_key, fair_tenant_key
from weclaw_mq.state.fair_book import FairBook, RedisFairBook

_T = TypeVar("_T")


def test_the_redis_fair_book_keeps_the_models_rules(redis_url: str) -> None:
    class RedisBookModel(FairBookModel):
        def make_book(self) -> FairBook:
            self.loop = asyncio.new_event_loop()
            self.client = aioredis.Redis.from_url(redis_url, socket_timeout=10)
            return RedisFairBook(self.client)

        def run(self, call: Awaitable[_T]) -> _T:
            return self.loop.run_until_complete(_awaited(call))

        def teardown(self) -> None:
            async def forget() -> None:
                # The book's own keys, named: a SCAN per example walked the whole shared
                # keyspace, and with 100k keys of other tests there the run passed 120 s.
                newcomers = [f"new-{i}" for i in range(next(self.newcomers))]
                tenants = (fair_tenant_key(self.queue, t) for t in [*TENANTS, *newcomers])
                await self.client.delete(
                    fair_key(self.queue), fair_flying_key(self.queue), *tenants
                )
                await self.client.aclose()

            self.run(forget())
            self.loop.close()

    run_state_machine_as_test(
        RedisBookModel,
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # a failure is reported as drawn
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


async def _awaited(call: Awaitable[_T]) -> _T:
    return await call

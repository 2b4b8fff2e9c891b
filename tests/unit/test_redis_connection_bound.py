"""The bound the worker checks its Redis pool size against covers every bounded path."""

from __future__ import annotations

import pytest

from weclaw_mq import App, Settings, Worker
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.llm.limiting import ROUND_TRIPS_IN_FLIGHT
from weclaw_mq.state.pipelining import DEFAULT_MAX_IN_FLIGHT
from weclaw_mq.streaming.redis import WRITES_IN_FLIGHT
from weclaw_mq.worker.consume import REDIS_CONNECTIONS_NEEDED


def test_the_checked_bound_covers_each_pool_of_a_worker() -> None:
    # The store: its auto-pipeline's round trips, the cancel subscription, one lone command.
    assert REDIS_CONNECTIONS_NEEDED >= DEFAULT_MAX_IN_FLIGHT + 2
    # The stream store's writes; the limiter's round trips (its renewals among them).
    assert REDIS_CONNECTIONS_NEEDED >= WRITES_IN_FLIGHT
    assert REDIS_CONNECTIONS_NEEDED >= ROUND_TRIPS_IN_FLIGHT


def _worker(max_connections: int) -> Worker:
    settings = Settings(redis_max_connections=max_connections, _env_file=None)  # type: ignore[call-arg]
    app = App("bound", settings=settings)

    @app.handler("bound-q")
    async def handle(task: dict[str, int]) -> None:
        return None

    return Worker(app, concurrency=2000)


async def test_concurrency_2000_is_no_reason_to_refuse_a_guarded_worker() -> None:
    _worker(REDIS_CONNECTIONS_NEEDED)._check_redis_pool()  # no ConfigurationError


async def test_a_pool_smaller_than_the_bound_is_refused_before_connecting() -> None:
    with pytest.raises(ConfigurationError, match="needs up to 8 Redis connections per pool"):
        await _worker(REDIS_CONNECTIONS_NEEDED - 1).run()

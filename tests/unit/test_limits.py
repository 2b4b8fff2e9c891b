"""``Limit``: what a handler's limit accepts, its delay queues and its Redis key names."""

from __future__ import annotations

import pytest

from weclaw_mq import App, ConfigurationError, Limit
from weclaw_mq.contract.naming import delay_queue_name, limit_keys
from weclaw_mq.policy.delays import STEP_DELAYS_MS
from weclaw_mq.policy.limits import DEFER_LADDER_MS, as_limits, deferral_ms


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # neither kind
        {"concurrency": 0},
        {"rate": 0},
        {"concurrency": 1.5},
        {"concurrency": True},
        {"rate": 5, "per_s": 0},
        {"rate": 5, "key": "user_id"},  # a field name, not a function
    ],
)
def test_a_limit_that_cannot_work_is_refused_at_import(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Limit(**kwargs)  # type: ignore[arg-type]


def test_limit_accepts_one_a_list_or_none_and_nothing_else() -> None:
    one = Limit(concurrency=2)
    assert as_limits(one) == (one,)
    assert as_limits([one, Limit(rate=3)]) == (one, Limit(rate=3))
    assert as_limits(None) == ()
    with pytest.raises(ConfigurationError):
        as_limits([one, 2])  # type: ignore[list-item]


def test_a_deferral_waits_at_least_the_expected_wait_and_at_most_twice_it() -> None:
    assert deferral_ms(0) == 125
    for wait in (1, 124, 125, 126, 999, 1000, 1001, 7000, 15999):
        delay = deferral_ms(wait)
        assert delay in DEFER_LADDER_MS
        assert wait <= delay <= max(2 * wait, 125)
    # Past the ladder's top the task comes back after 16 s and asks again.
    assert deferral_ms(60_000) == 16_000


def test_a_limited_handler_declares_the_ladders_delay_queues() -> None:
    app = App("t")

    @app.handler("plain")
    async def plain(task: dict[str, int]) -> None: ...

    @app.handler("limited", limit=Limit(key=lambda t: t["user"], concurrency=2))
    async def limited(task: dict[str, int]) -> None: ...

    assert set(DEFER_LADDER_MS) <= set(app.handlers["limited"].queue_spec().retry_delays_ms)
    # A handler without a limit has only the step queues every handler has
    # (weclaw_mq.policy.delays).
    ladder_only = set(DEFER_LADDER_MS) - set(STEP_DELAYS_MS)
    assert ladder_only and not ladder_only & set(app.handlers["plain"].queue_spec().retry_delays_ms)
    assert delay_queue_name("limited", 125) == "limited.retry.lanes.125ms"


def test_limit_keys_share_one_hash_tag_whatever_the_key_holds() -> None:
    for key in ("u1", "", "}", "{x}", "a%7Db", "*"):
        slots, starts = limit_keys("q", 0, key)
        tag = slots[slots.index("{") + 1 : slots.index("}")]
        assert tag and starts[starts.index("{") + 1 : starts.index("}")] == tag
        assert slots.endswith(":slots") and starts.endswith(":starts")
    # Distinct keys, distinct tags (the escape is reversible); global and keyed never meet.
    keys = ["u1", "", "}", "{x}", "%7D", "*", None]
    assert len({limit_keys("q", 0, k)[0] for k in keys}) == len(keys)
    assert limit_keys("q", 0, "u1") != limit_keys("q", 1, "u1")


def test_a_token_limits_margin_is_learned_from_its_delays_and_a_429_raises_it_at_once() -> None:
    import redis.asyncio as aioredis

    from weclaw_mq.llm.limiting import MIN_MARGIN_MS, TOKEN_WINDOW_MARGIN_MS, Limiter

    def room(ms: float) -> int:
        return round(ms * 1.25)  # MARGIN_HEADROOM

    limiter = Limiter(aioredis.Redis(), lease_s=1)  # no round trip: learning is local
    assert limiter.margin_ms("k") == TOKEN_WINDOW_MARGIN_MS  # nothing measured yet
    for delay in (10.0, 20.0, 30.0):
        limiter.learned("k", delay, refused=False)
    assert limiter.margin_ms("k") == MIN_MARGIN_MS  # short delays: the floor
    limiter.learned("k", 640.0, refused=False)
    assert limiter.margin_ms("k") == room(640)  # under 100 samples: the longest
    assert limiter.margin_ms("other") == TOKEN_WINDOW_MARGIN_MS  # per key
    for _ in range(200):
        limiter.learned("k", 100.0, refused=False)
    assert limiter.margin_ms("k") == room(100)  # the 99th percentile of the last 200
    limiter.learned("k", 900.0, refused=False)
    assert limiter.margin_ms("k") == room(100)  # one late call among 200 is not the percentile..
    limiter.learned("k", 900.0, refused=True)
    assert limiter.margin_ms("k") == room(900)  # ...but one that met a 429 raises it at once
    limiter.learned("k", 100.0, refused=False)
    assert limiter.margin_ms("k") == room(900)  # and holds it while it is among the samples
    for _ in range(200):
        limiter.learned("k", 100.0, refused=False)
    assert limiter.margin_ms("k") == room(100)

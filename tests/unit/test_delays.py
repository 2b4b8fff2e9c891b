"""Arbitrary delays on a bounded set of delay queues (weclaw_mq.policy.delays), the Retry-After
reader and Retry(after_s=) in the retry decision: pure, no broker."""

from __future__ import annotations

import logging
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import SecretStr

from weclaw_mq import App, ConfigurationError, Retry, RetryPolicy, Settings, retry_after_s
from weclaw_mq.contract import headers as h
from weclaw_mq.policy.delays import (
    MIN_STEP_MS,
    STEP_DELAYS_MS,
    hops_ms,
    next_hop_ms,
    schedule,
)
from weclaw_mq.policy.retry import GiveUp, RetryLater, decide, delay_queue_set

LONGEST_STEP_MS = STEP_DELAYS_MS[-1]


def test_the_step_queues_are_powers_of_4_seconds_from_1_to_1024() -> None:
    assert STEP_DELAYS_MS == (1_000, 4_000, 16_000, 64_000, 256_000, 1_024_000)


@pytest.mark.parametrize(
    "policy",
    [RetryPolicy(), RetryPolicy(max_retries=0, delay_s=0.05), RetryPolicy(max_retries=9)],
)
def test_any_delay_is_served_by_the_same_bounded_set_never_early_at_most_1_s_late(
    policy: RetryPolicy,
) -> None:
    queues = delay_queue_set(policy)
    # Bounded: the steps and the policy's own delays, whatever delays are asked for.
    assert set(queues) == {*STEP_DELAYS_MS, policy.delay_ms(1), *policy.delays_ms()}
    assert list(queues) == sorted(queues)
    rng = random.Random(13)
    delays = [0, 1, 999, 1_000, 1_001, 3_000, 3_500, 20_000, 86_400_000]
    delays += [rng.randrange(0, 3 * LONGEST_STEP_MS) for _ in range(2_000)]
    for delay in delays:
        hops = hops_ms(delay, queues)
        assert set(hops) <= set(queues), delay
        # At least the delay; at most the shortest step (1 s) more.
        assert delay <= sum(hops) < delay + MIN_STEP_MS, (delay, hops)
        # At most 3 hops per power of 4 below it, and one per 1024 s above that.
        assert len(hops) <= 3 * len(STEP_DELAYS_MS) + delay // LONGEST_STEP_MS, (delay, hops)


def test_a_delay_takes_the_longest_queue_that_fits_the_policy_ones_included() -> None:
    queues = delay_queue_set(RetryPolicy())  # 5, 10, 20 s besides the steps
    assert hops_ms(3_000, queues) == [1_000, 1_000, 1_000]
    assert hops_ms(20_000, queues) == [20_000]  # a policy delay: one hop, as before
    assert hops_ms(30_000, queues) == [20_000, 10_000]
    assert hops_ms(2_500, queues) == [1_000, 1_000, 1_000]  # 0.5 s late
    assert next_hop_ms(0, queues) == 1_000
    assert next_hop_ms(10 * LONGEST_STEP_MS, queues) == LONGEST_STEP_MS


def test_only_a_hop_shorter_than_its_delay_carries_a_not_before_time() -> None:
    headers: dict[str, object] = {h.NOT_BEFORE: 1}
    schedule(headers, 3_000, 1_000, at_ms=10_000)
    assert headers[h.NOT_BEFORE] == 13_000
    schedule(headers, 5_000, 5_000, at_ms=10_000)  # a policy retry travels as it always did
    assert h.NOT_BEFORE not in headers


NOW = datetime(2026, 12, 1, 3, 0, 0, tzinfo=UTC)


def _http_date(at: datetime) -> str:
    return at.strftime("%a, %d %b %Y %H:%M:%S GMT")


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s("3") == 3.0
    assert retry_after_s(" 120 ") == 120.0
    assert retry_after_s("0") == 0.0
    assert retry_after_s(_http_date(NOW + timedelta(seconds=30)), now=NOW) == 30.0
    assert retry_after_s(_http_date(NOW - timedelta(seconds=30)), now=NOW) == 0.0  # past: now


@pytest.mark.parametrize("garbage", ["soon", "-1", "", "nan", "inf", "Wed, 99 Foo 2026 xx GMT"])
def test_unreadable_retry_after_falls_back_to_the_default_and_says_so(
    garbage: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert retry_after_s(garbage) is None  # None: Retry uses the policy's delay
        assert retry_after_s(garbage, default=7.0) == 7.0
    assert "unreadable Retry-After" in caplog.text
    assert retry_after_s(None, default=2.0) == 2.0  # absent: no warning needed


def test_retry_after_s_replaces_the_policy_delay_and_still_spends_one_attempt() -> None:
    policy = RetryPolicy(max_retries=2)
    assert decide(1, Retry("rate limited", after_s=3), policy) == RetryLater(3_000)
    assert decide(1, Retry("rate limited", after_s=0.0004), policy) == RetryLater(1)
    assert decide(2, Retry("busy"), policy) == RetryLater(policy.delay_ms(2))
    assert decide(1, Retry(after_s=None), policy) == RetryLater(policy.delay_ms(1))
    # It counts as an attempt: past max_retries it gives up like any failure.
    assert isinstance(decide(3, Retry(after_s=3), policy), GiveUp)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "3", True])
def test_a_bad_after_s_is_refused_where_it_is_written(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="after_s"):
        Retry(after_s=bad)  # type: ignore[arg-type]


def _app() -> App:
    return App("unit", settings=Settings(amqp_url=SecretStr("amqp://guest:guest@127.0.0.1:1/")))


def test_prepare_writes_the_not_before_time_and_refuses_a_delay_past_the_lifetime() -> None:
    app = _app()
    message = app.prepare("q", {"x": 1}, delay_s=30)
    hdrs: dict[str, Any] = dict(message.headers)
    # Counted from the same instant as the lifetime.
    assert hdrs[h.NOT_BEFORE] == hdrs[h.EXPIRES_AT] - hdrs[h.TTL_MS] + 30_000
    assert h.NOT_BEFORE not in app.prepare("q", {"x": 1}).headers
    assert h.NOT_BEFORE not in app.prepare("q", {"x": 1}, delay_s=0).headers
    with pytest.raises(ConfigurationError, match="lifetime"):
        app.prepare("q", {"x": 1}, delay_s=60, ttl_s=60)
    with pytest.raises(ConfigurationError, match="delay_s"):
        app.prepare("q", {"x": 1}, delay_s=-1)

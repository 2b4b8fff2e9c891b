"""The retry policy and the pure ack/retry/dead-letter decision, without a broker."""

from __future__ import annotations

import pytest

from weclaw_mq import App, ConfigurationError, Reject, Retry, RetryPolicy, Settings
from weclaw_mq.policy.retry import Ack, DeadLetterReason, GiveUp, RetryLater, decide


def test_default_policy_waits_5_10_20_seconds_then_gives_up() -> None:
    policy = RetryPolicy()
    assert policy.max_retries == 3
    assert [policy.delay_ms(n) for n in (1, 2, 3)] == [5_000, 10_000, 20_000]
    assert policy.delays_ms() == (5_000, 10_000, 20_000)


def test_settings_defaults_match_the_default_policy() -> None:
    # App.handler builds its policy from settings when none is given: the two must agree.
    # Read the declared defaults, not Settings(), so a WECLAW_MQ_* variable cannot interfere.
    fields = Settings.model_fields
    from_settings = RetryPolicy(
        max_retries=fields["max_retries"].default,
        delay_s=fields["retry_delay_s"].default,
        multiplier=fields["retry_multiplier"].default,
        max_delay_s=fields["retry_max_delay_s"].default,
    )
    assert from_settings == RetryPolicy()


def test_a_handler_without_its_own_policy_takes_the_settings_one() -> None:
    settings = Settings(
        max_retries=1, retry_delay_s=0.5, retry_multiplier=3.0, retry_max_delay_s=9.0
    )
    app = App("t", settings=settings)

    @app.handler("policy-from-settings")
    async def handle(task: dict[str, str]) -> None:
        pass

    expected = RetryPolicy(max_retries=1, delay_s=0.5, multiplier=3.0, max_delay_s=9.0)
    assert settings.retry_policy() == expected
    assert app.handlers["policy-from-settings"].retry == expected


def test_delay_grows_by_the_multiplier() -> None:
    policy = RetryPolicy(max_retries=4, delay_s=0.25, multiplier=3)
    assert [policy.delay_ms(n) for n in (1, 2, 3, 4)] == [250, 750, 2_250, 6_750]


def test_delay_is_capped_at_max_delay_s() -> None:
    policy = RetryPolicy(max_retries=6, delay_s=1, multiplier=2, max_delay_s=5)
    assert [policy.delay_ms(n) for n in range(1, 7)] == [1_000, 2_000, 4_000, 5_000, 5_000, 5_000]


def test_delay_before_the_first_attempt_is_treated_as_the_first_delay() -> None:
    # attempt numbers are 1-based; 0 or negative must not produce a shorter delay
    policy = RetryPolicy(delay_s=2, multiplier=2)
    assert policy.delay_ms(0) == policy.delay_ms(1) == 2_000


def test_capped_delays_are_listed_once_so_one_delay_queue_serves_them() -> None:
    policy = RetryPolicy(max_retries=6, delay_s=1, multiplier=2, max_delay_s=5)
    assert policy.delays_ms() == (1_000, 2_000, 4_000, 5_000)


def test_constant_backoff_has_a_single_delay() -> None:
    policy = RetryPolicy(max_retries=5, delay_s=0.1, multiplier=1)
    assert policy.delays_ms() == (100,)


def test_no_retries_means_no_delay_queues() -> None:
    assert RetryPolicy(max_retries=0).delays_ms() == ()


def test_successful_attempt_is_acked() -> None:
    policy = RetryPolicy(max_retries=3)
    assert decide(1, None, policy) == Ack()
    # even on the last permitted attempt, or beyond it: success always acks
    assert decide(4, None, policy) == Ack()


def test_reject_dead_letters_at_once_whatever_the_attempt() -> None:
    policy = RetryPolicy(max_retries=3)
    for attempt in (1, 2, 4):
        assert decide(attempt, Reject("bad prompt"), policy) == GiveUp(DeadLetterReason.REJECTED)


def test_failed_attempts_within_the_budget_retry_with_the_policy_delay() -> None:
    policy = RetryPolicy(max_retries=3, delay_s=0.1, multiplier=2)
    err = RuntimeError("model timed out")
    assert decide(1, err, policy) == RetryLater(100)
    assert decide(2, err, policy) == RetryLater(200)
    assert decide(3, err, policy) == RetryLater(400)


def test_failure_after_max_retries_dead_letters_as_retries_exhausted() -> None:
    policy = RetryPolicy(max_retries=3)
    # attempt 4 is the 3rd retry: its failure is the end
    assert decide(4, RuntimeError("still broken"), policy) == GiveUp(
        DeadLetterReason.RETRIES_EXHAUSTED
    )
    assert decide(9, RuntimeError("still broken"), policy) == GiveUp(
        DeadLetterReason.RETRIES_EXHAUSTED
    )


def test_zero_retries_dead_letters_the_first_failure() -> None:
    decision = decide(1, ValueError("nope"), RetryPolicy(max_retries=0))
    assert decision == GiveUp(DeadLetterReason.RETRIES_EXHAUSTED)


def test_retry_signal_is_retried_like_a_failure() -> None:
    policy = RetryPolicy(max_retries=2, delay_s=0.05)
    assert decide(1, Retry("rate limited"), policy) == RetryLater(50)
    assert decide(3, Retry("rate limited"), policy) == GiveUp(DeadLetterReason.RETRIES_EXHAUSTED)


def test_dead_letter_reasons_keep_their_wire_values() -> None:
    # these strings are written into DLQ headers and read by ops tooling: new reasons may be
    # added, but the existing ones must never change
    assert DeadLetterReason.UNDECODABLE.value == "undecodable"
    assert DeadLetterReason.INVALID_PAYLOAD.value == "invalid_payload"
    assert DeadLetterReason.REJECTED.value == "rejected"
    assert DeadLetterReason.RETRIES_EXHAUSTED.value == "retries_exhausted"
    assert len({r.value for r in DeadLetterReason}) == len(DeadLetterReason)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_retries": -1}, "max_retries"),
        ({"delay_s": 0}, "delay_s"),
        ({"delay_s": -1}, "delay_s"),
        ({"max_delay_s": 0}, "max_delay_s"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"delay_s": 0.0001}, "1 ms"),
    ],
)
def test_policy_refuses_options_that_cannot_work(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_is_immutable() -> None:
    policy = RetryPolicy()
    with pytest.raises(AttributeError):
        policy.max_retries = 10  # type: ignore[misc]

"""The circuit breaker's state machine (``policy.breaker.Circuit``), on a hand-moved clock."""

from __future__ import annotations

import pytest

from weclaw_mq import App, Breaker, ConfigurationError, UpstreamDown
from weclaw_mq.policy.breaker import Circuit, CircuitState

CLOSED, OPEN, HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def circuit(**options: object) -> tuple[Circuit, Clock]:
    clock = Clock()
    breaker = Breaker(**{"failures": 3, "window_s": 10.0, "cooldown_s": 5.0, **options})  # type: ignore[arg-type]
    return Circuit(breaker, clock), clock


def test_k_failures_within_the_window_open_it_and_fewer_do_not() -> None:
    c, clock = circuit()
    assert c.record(UpstreamDown()) is None
    clock.now += 1
    assert c.record(UpstreamDown()) is None
    assert c.state is CLOSED
    clock.now += 1
    assert c.record(UpstreamDown()) is OPEN
    assert c.probe_at == clock.now + 5.0


def test_failures_older_than_the_window_do_not_count() -> None:
    c, clock = circuit()
    c.record(UpstreamDown())
    c.record(UpstreamDown())
    clock.now += 10.0  # both just left the window
    assert c.record(UpstreamDown()) is None
    assert c.state is CLOSED


def test_only_the_errors_it_is_told_of_count_and_successes_do_not_reset() -> None:
    c, _ = circuit()
    c.record(UpstreamDown())
    c.record(UpstreamDown())
    assert c.record(ValueError("a bug, not an outage")) is None
    assert c.record(None) is None
    assert c.state is CLOSED
    assert c.record(UpstreamDown()) is OPEN


@pytest.mark.parametrize(
    ("on", "error", "counts"),
    [
        (Exception, ValueError(), True),
        ((TimeoutError, ConnectionError), ConnectionRefusedError(), True),
        ((TimeoutError, ConnectionError), UpstreamDown(), False),
        (UpstreamDown, None, False),
    ],
)
def test_on_takes_a_class_or_a_tuple(
    on: type[BaseException] | tuple[type[BaseException], ...],
    error: BaseException | None,
    counts: bool,
) -> None:
    assert Breaker(on=on).counts(error) is counts


def test_after_the_cooldown_one_probe_closes_it_on_success() -> None:
    c, clock = circuit()
    for _ in range(3):
        c.record(UpstreamDown())
    clock.now += 4.9
    assert c.half_open() is None
    assert c.state is OPEN
    clock.now += 0.1
    assert c.half_open() is HALF_OPEN
    assert c.probe_at is None
    assert c.record(None, probe=True) is CLOSED
    # Closed afresh: the failures before the outage are forgotten.
    c.record(UpstreamDown())
    c.record(UpstreamDown())
    assert c.state is CLOSED


def test_a_failed_probe_reopens_it_for_another_cooldown() -> None:
    c, clock = circuit()
    for _ in range(3):
        c.record(UpstreamDown())
    clock.now += 5
    c.half_open()
    clock.now += 2  # the probe ran 2 s
    assert c.record(UpstreamDown(), probe=True) is OPEN
    assert c.probe_at == clock.now + 5.0


def test_outcomes_of_tasks_started_before_it_opened_change_nothing() -> None:
    c, clock = circuit()
    for _ in range(3):
        c.record(UpstreamDown())
    assert c.record(UpstreamDown()) is None  # running when it opened
    assert c.record(None) is None
    assert c.state is OPEN
    clock.now += 5
    c.half_open()
    assert c.record(None) is None  # not the probe
    assert c.record(UpstreamDown()) is None
    assert c.state is HALF_OPEN


def test_a_probe_that_never_ran_reopens_it() -> None:
    c, clock = circuit()
    assert c.reopen() is None  # only from HALF_OPEN
    for _ in range(3):
        c.record(UpstreamDown())
    clock.now += 5
    c.half_open()
    assert c.reopen() is OPEN
    assert c.probe_at == clock.now + 5.0


def test_the_attempts_bound_is_k_plus_the_others_running_plus_a_probe_per_cooldown() -> None:
    breaker = Breaker(failures=5, window_s=30, cooldown_s=20)
    assert breaker.attempts_bound(concurrency=1, outage_s=0) == 5 + 0 + 1
    assert breaker.attempts_bound(concurrency=4, outage_s=60) == 5 + 3 + 3 + 1


@pytest.mark.parametrize(
    "options",
    [
        {"failures": 0},
        {"window_s": 0},
        {"cooldown_s": -1},
        {"on": ()},
        {"on": "UpstreamDown"},
        {"on": (ValueError, int)},
    ],
)
def test_bad_options_fail_at_import(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Breaker(**options)  # type: ignore[arg-type]


def test_a_handler_takes_a_breaker_and_refuses_anything_else() -> None:
    app = App("t")
    breaker = Breaker(failures=2)

    @app.handler("with-breaker", breaker=breaker)
    async def guarded(task: dict[str, int]) -> None: ...

    assert app.handlers["with-breaker"].breaker is breaker
    with pytest.raises(ConfigurationError, match="must be a Breaker"):

        @app.handler("bad-breaker", breaker={"failures": 2})  # type: ignore[arg-type]
        async def wrong(task: dict[str, int]) -> None: ...

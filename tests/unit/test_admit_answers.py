"""What an ``admit`` hook's ``Defer`` becomes in the worker (``worker.admit_hooks.parked``),
and the answers ``Defer`` refuses at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from weclaw_mq import App, Defer
from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.worker import ends
from weclaw_mq.worker.admit_hooks import parked


@pytest.fixture
def spec() -> HandlerSpec:
    app = App("admit-answers")

    @app.handler("q")
    async def work(task: dict[str, int]) -> None:
        return None

    return app.handlers["q"]


def test_a_deferral_until_a_time_parks_the_task_until_then(spec: HandlerSpec) -> None:
    until = datetime.now(UTC) + timedelta(minutes=10)
    end = parked(Defer("later", until=until, by="quota"), spec)
    assert isinstance(end, ends.Defer)
    assert end.not_before_ms == round(until.timestamp() * 1000)
    assert (end.by, end.queued_again, end.at_midnight) == ("quota", True, False)
    assert end.delay_ms is not None and 0 < end.delay_ms <= 10 * 60_000


def test_a_deferral_until_the_next_utc_midnight_takes_the_midnight_queue(
    spec: HandlerSpec,
) -> None:
    tomorrow = datetime.now(UTC).date() + timedelta(days=1)
    midnight = datetime.combine(tomorrow, datetime.min.time(), UTC)
    end = parked(Defer("over today's quota", until=midnight), spec)
    assert isinstance(end, ends.Defer) and end.at_midnight and end.by == "middleware"


def test_a_deferral_after_a_delay_is_due_that_long_from_now(spec: HandlerSpec) -> None:
    before = now_ms()
    end = parked(Defer("shut", after_s=2.5), spec)
    assert isinstance(end, ends.Defer) and end.not_before_ms is not None
    assert before + 2500 <= end.not_before_ms <= now_ms() + 2500


def test_a_bare_deferral_waits_the_first_retry_delay(spec: HandlerSpec) -> None:
    end = parked(Defer("not now"), spec)
    assert end == ends.Defer("not now", queued_again=True, by="middleware")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"until": datetime(2030, 1, 1), "by": "x"}, "aware datetime"),
        ({"until": datetime(2030, 1, 1, tzinfo=UTC), "after_s": 1.0}, "not both"),
        ({"after_s": -1.0}, "0..86400"),
        ({"by": ""}, "printable"),
        ({"by": "a\nb"}, "printable"),
    ],
)
def test_a_deferral_that_cannot_be_kept_is_refused_at_once(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Defer("why", **kwargs)  # type: ignore[arg-type]

"""The TTL rules that need no broker: deadlines on the wire, and how a record reads past one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from weclaw_mq import App, ConfigurationError, Settings, TaskState, TaskStatus
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import DEFAULT_TTL_S, left_ms, renewed
from weclaw_mq.state.expiry import as_seen_at, record_ttl_s, until_deadline_s

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _state(status: TaskStatus, expires_at: datetime | None = T0) -> TaskState:
    return TaskState(task_id="t", queue="q", status=status, expires_at=expires_at)


@pytest.mark.parametrize("status", [TaskStatus.QUEUED, TaskStatus.RETRYING])
def test_a_waiting_record_reads_as_expired_from_its_deadline_on(status: TaskStatus) -> None:
    before = as_seen_at(_state(status), T0 - timedelta(milliseconds=1))
    after = as_seen_at(_state(status), T0)

    assert before is not None and before.status is status
    assert after is not None and (after.status, after.reason) == (TaskStatus.EXPIRED, "expired")
    assert after.status.terminal


@pytest.mark.parametrize(
    "status", [TaskStatus.RUNNING, TaskStatus.SUCCEEDED, TaskStatus.DEAD_LETTERED]
)
def test_a_record_a_worker_owns_is_never_read_as_expired(status: TaskStatus) -> None:
    # Running: a worker took it in time and writes its end; final records are final.
    seen = as_seen_at(_state(status), T0 + timedelta(days=30))
    assert seen is not None and seen.status is status


def test_a_record_without_a_deadline_never_expires() -> None:
    seen = as_seen_at(_state(TaskStatus.QUEUED, None), T0 + timedelta(days=3650))
    assert seen is not None and seen.status is TaskStatus.QUEUED
    assert until_deadline_s(_state(TaskStatus.QUEUED, None), T0) is None


def test_a_waiting_record_outlives_its_deadline_by_the_record_ttl() -> None:
    waiting = _state(TaskStatus.QUEUED, T0 + timedelta(days=7))
    assert record_ttl_s(waiting, 86_400, T0) == 8 * 86_400
    assert record_ttl_s(_state(TaskStatus.SUCCEEDED, T0 + timedelta(days=7)), 86_400, T0) == 86_400


def test_the_deadline_header_gives_the_time_left() -> None:
    assert left_ms({h.EXPIRES_AT: 1_500}, 1_000) == 500
    assert left_ms({h.EXPIRES_AT: 1_500}, 2_000) == -500
    # A foreign producer's header of another type is no deadline, not an error.
    assert left_ms({h.EXPIRES_AT: "soon"}, 0) is None
    assert left_ms({}, 0) is None


def test_a_renewal_without_a_first_lifetime_drops_the_old_deadline() -> None:
    out, ttl = renewed({h.EXPIRES_AT: 5, "k": 1}, 1_000)
    assert (out, ttl) == ({"k": 1}, None)


def test_publish_stamps_the_lifetime_from_the_call_the_handler_or_the_settings() -> None:
    app = App("ttl-unit", settings=Settings(task_ttl_s=60))

    @app.handler("ttl-unit-h", ttl_s=2.5)
    async def handle(task: dict[str, int]) -> None:
        return None

    by_handler = app.prepare("ttl-unit-h", {})
    by_call = app.prepare("ttl-unit-h", {}, ttl_s=0.25)
    by_settings = app.prepare("ttl-unit-other", {})

    assert by_handler.headers[h.TTL_MS] == 2_500 and by_handler.expiration == 2.5
    assert by_call.headers[h.TTL_MS] == 250 and by_call.expiration == 0.25
    assert by_settings.headers[h.TTL_MS] == 60_000
    deadline = by_call.headers[h.EXPIRES_AT]
    assert isinstance(deadline, int) and by_call.timestamp is not None
    assert 0 < deadline - by_call.timestamp.timestamp() * 1000 <= 300
    assert Settings().task_ttl_s == DEFAULT_TTL_S == 7 * 24 * 3600


@pytest.mark.parametrize("bad", [0, -1, 0.0001, float("nan"), float("inf"), "5", True])
def test_a_lifetime_that_is_no_positive_number_is_refused(bad: object) -> None:
    app = App("ttl-unit-bad")
    with pytest.raises(ConfigurationError, match="ttl_s"):
        app.prepare("q", {}, ttl_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ttl_s"):

        @app.handler("ttl-unit-bad-h", ttl_s=bad)  # type: ignore[arg-type]
        async def handle(task: dict[str, int]) -> None:
            return None

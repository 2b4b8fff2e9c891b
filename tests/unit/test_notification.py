"""The pure parts of result notifications: the option, the message id, the results queue."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from weclaw_mq import App, ConfigurationError, Settings, TaskNotification, TaskStatus
from weclaw_mq.contract.message import SHORTSTR_MAX_BYTES
from weclaw_mq.handlers.notifications import notification_id, notify_target
from weclaw_mq.wire.topology import queue_declarations, work_queue_arguments


class Job(BaseModel):
    text: str


def _app(**overrides: object) -> App:
    return App("unit", settings=Settings(**overrides))  # type: ignore[arg-type]


def test_notify_true_announces_to_the_handler_queue_dot_results() -> None:
    target = notify_target("ai-replies", True, Settings())
    assert target is not None and target.queue == "ai-replies.results"
    assert notify_target("ai-replies", False, Settings()) is None
    named = notify_target("ai-replies", "notifications", Settings())
    assert named is not None and named.queue == "notifications"


@pytest.mark.parametrize(
    ("notify", "complaint"),
    [
        ("ai-replies", "the handler's own queue"),
        ("x.dlq", "derived queues"),
        ("amq.results", "reserved"),
        ("", "1 to 200 bytes"),
        (3, "True, False or a queue name"),
    ],
)
def test_a_notify_target_that_cannot_work_fails_at_decoration(
    notify: object, complaint: str
) -> None:
    app = _app()
    with pytest.raises(ConfigurationError, match=complaint):

        @app.handler("ai-replies", notify=notify)  # type: ignore[arg-type]
        async def work(task: Job) -> None: ...


def test_a_results_queue_name_too_long_for_a_handler_of_its_own_fails_at_decoration() -> None:
    with pytest.raises(ConfigurationError, match="notify for"):
        notify_target("q" * 195, True, Settings())  # q*195 + ".results" is over 200 bytes


def test_notify_needs_results_because_a_copy_resends_from_the_stored_record() -> None:
    with pytest.raises(ConfigurationError, match="WECLAW_MQ_RESULTS_ENABLED"):
        notify_target("ai-replies", True, Settings(results_enabled=False))


def test_the_results_queue_is_declared_last_with_default_handler_queue_arguments() -> None:
    app = _app(delivery_limit=7)

    @app.handler("ai-replies", notify=True, delivery_limit=3, max_length=50)
    async def work(task: Job) -> None: ...

    decls = queue_declarations(app.handlers["ai-replies"].queue_spec())
    names = [name for name, _ in decls]
    assert names[-2:] == ["ai-replies.results.dlq", "ai-replies.results"]
    results_args = dict(decls)["ai-replies.results"]
    # What a handler on ai-replies.results with default options declares: the same queue,
    # whoever declares it first; not the producing handler's own limit and length.
    consumer = _app(delivery_limit=7)

    @consumer.handler("ai-replies.results")
    async def notified(note: TaskNotification) -> None: ...

    assert results_args == work_queue_arguments(
        consumer.handlers["ai-replies.results"].queue_spec()
    )
    assert results_args["x-delivery-limit"] == 7 and "x-max-length" not in results_args


def test_a_handler_without_notify_declares_no_results_queue() -> None:
    app = _app()

    @app.handler("ai-replies")
    async def work(task: Job) -> None: ...

    names = [name for name, _ in queue_declarations(app.handlers["ai-replies"].queue_spec())]
    assert not any(name.endswith(".results") or ".results." in name for name in names)


def test_notification_ids_differ_per_final_status_and_requeue_but_not_per_copy() -> None:
    assert notification_id("t-1", TaskStatus.SUCCEEDED) == "succeeded:t-1"
    # succeeded is final: a requeue count never makes a second success notification.
    assert notification_id("t-1", TaskStatus.SUCCEEDED, 2) == "succeeded:t-1"
    # So is cancelled: every copy of a cancelled task repeats one notification.
    assert notification_id("t-1", TaskStatus.CANCELLED) == "cancelled:t-1"
    assert notification_id("t-1", TaskStatus.CANCELLED, 3) == "cancelled:t-1"
    assert notification_id("t-1", TaskStatus.DEAD_LETTERED) == "dead_lettered:0:t-1"
    assert notification_id("t-1", TaskStatus.DEAD_LETTERED, 1) == "dead_lettered:1:t-1"
    # Unambiguous whatever the task id holds.
    assert notification_id("0:t", "dead_lettered") != notification_id("t", "dead_lettered", 0)


def test_a_notification_id_too_long_for_amqp_becomes_a_stable_uuid() -> None:
    long_id = "é" * 127  # 254 bytes: a valid task id, too long with the status in front
    first = notification_id(long_id, TaskStatus.SUCCEEDED)
    assert len(first.encode()) <= SHORTSTR_MAX_BYTES
    assert first == notification_id(long_id, TaskStatus.SUCCEEDED)
    assert first != notification_id(long_id, TaskStatus.DEAD_LETTERED)


def test_a_notification_round_trips_as_json_and_names_itself() -> None:
    note = TaskNotification(
        task_id="t-1",
        queue="ai-replies",
        status=TaskStatus.DEAD_LETTERED,
        error="Reject: empty prompt",
        error_type="weclaw_mq.Reject",
        reason="rejected",
        attempt=1,
        requeued=1,
        trace_id="trace",
    )
    again = TaskNotification.model_validate_json(note.model_dump_json())
    assert again == note
    assert again.notification_id == "dead_lettered:1:t-1"


def test_a_final_status_this_version_does_not_know_still_reads_and_has_an_id() -> None:
    body = (
        '{"task_id": "t-1", "queue": "q", "status": "expired", "attempt": 0, "requeued": 0,'
        ' "trace_id": "tr", "finished_at": "2026-12-01T00:00:00Z"}'
    )
    note = TaskNotification.model_validate_json(body)
    assert note.status == "expired"
    assert note.notification_id == "expired:0:t-1"
    assert (
        TaskNotification.model_validate_json(body.replace("expired", "succeeded")).status
        is TaskStatus.SUCCEEDED
    )

"""``weclaw-mq inspect``'s pure parts: the record a worker's beat makes from its deliveries
(bounded, longest-running first), the record's JSON both ways, and the table and document
the command prints. The command against real workers: tests/integration/test_inspect.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from weclaw_mq.cli.inspect_command import document, duration, table, unserved
from weclaw_mq.state.worker_registry import (
    LISTED_TASKS_MAX,
    RunningTask,
    WorkerRecord,
    WorkerRegistry,
)
from weclaw_mq.worker.beat import Beat
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.deadlines import Deadlines


def record(**overrides: object) -> WorkerRecord:
    fields: dict[str, object] = {
        "worker_id": "w1",
        "app": "demo",
        "host": "box",
        "pid": 42,
        "started_at": "2026-01-02T03:04:05+00:00",
        "uptime_s": 3725.0,
        "queues": ("ai-replies", "other"),
        "concurrency": 2,
        "state": "consuming",
        "in_flight": 5,
        "tasks": (
            RunningTask("t-long", "ai-replies", 2, 75.25),
            RunningTask("t-waiting", "other", 1, None),
        ),
        "more": 3,
        "beat_s": 5.0,
        "ttl_s": 15.0,
        "last_beat_s": 1.25,
    }
    return WorkerRecord(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.0, "0.0s"),
        (-0.2, "0.0s"),  # clocks: never a negative age
        (4.24, "4.2s"),
        (59.96, "1m00s"),
        (605.0, "10m05s"),
        (3725.0, "1h02m"),
        (2 * 86400 + 5 * 3600 + 10, "2d05h"),
    ],
)
def test_durations_read_at_a_glance(seconds: float, shown: str) -> None:
    assert duration(seconds) == shown


def test_the_table_has_a_row_per_worker_then_its_tasks_and_how_many_more() -> None:
    idle = record(
        worker_id="w2", host="other-box", pid=7, in_flight=0, tasks=(), more=0, queues=("x",)
    )

    lines = table("demo", ["ai-replies", "other", "lonely"], [record(), idle])

    assert lines[0] == "2 live worker(s) of app 'demo':"
    header = lines[2].split()
    assert header[:3] == ["WORKER", "HOST", "PID"] and header[-1] == "QUEUES"
    assert lines[3].split() == [
        *("w1", "box", "42", "consuming", "2", "5", "1h02m", "1.2s", "ago"),
        *("ai-replies,", "other"),
    ]
    assert lines[4].split()[:3] == ["w2", "other-box", "7"]
    tasks = lines[lines.index("worker w1 (box pid 42): runs 5 task(s)") + 1 :]
    assert tasks[0].split() == ["TASK", "ID", "QUEUE", "ATTEMPT", "RUNNING", "FOR"]
    assert tasks[1].split() == ["t-long", "ai-replies", "2", "1m15s"]
    assert tasks[2].split() == ["t-waiting", "other", "1", "not", "started"]
    assert tasks[3] == "  ... and 3 more (a record lists at most 2)"
    assert "worker w2 (other-box pid 7): runs no task" in lines
    assert lines[-1] == "no live worker consumes: lonely"


def test_no_live_worker_is_one_line_naming_the_queues() -> None:
    assert table("demo", ["a", "b"], []) == [
        "no live worker consumes the queues of app 'demo' (a, b)"
    ]
    assert unserved(["a", "b"], []) == ["a", "b"]


def test_the_json_document_holds_every_field_rounded() -> None:
    shown = json.loads(json.dumps(document("demo", ["ai-replies", "gone"], [record()])))

    assert shown["app"] == "demo" and shown["queues"] == ["ai-replies", "gone"]
    assert shown["unserved_queues"] == ["gone"]
    (worker,) = shown["workers"]
    assert worker == {
        **worker,
        **{"worker_id": "w1", "host": "box", "pid": 42, "concurrency": 2, "more": 3},
        **{"queues": ["ai-replies", "other"], "last_beat_s": 1.25, "state": "consuming"},
    }
    assert worker["tasks"][0] == {
        "task_id": "t-long",
        "queue": "ai-replies",
        "attempt": 2,
        "running_s": 75.25,
    }
    assert worker["tasks"][1]["running_s"] is None


def test_a_record_reads_back_as_written_and_is_aged_by_the_reader() -> None:
    written = record(last_beat_s=0.0)

    text = written.to_json()

    assert "last_beat_s" not in json.loads(text)  # the reader's to say
    assert WorkerRecord.from_json(text) == written
    assert WorkerRecord.from_json(text.encode()) == written
    aged = written.aged(2.0)
    assert (aged.uptime_s, aged.last_beat_s) == (3727.0, 2.0)
    assert [t.running_s for t in aged.tasks] == [77.25, None]


def test_the_table_names_a_workers_breakers_that_are_not_closed() -> None:
    lines = table("demo", ["ai-replies"], [record(breakers={"ai-replies": "half_open"})])
    assert "  breaker not closed: ai-replies half open" in lines
    assert not any("breaker" in line for line in table("demo", ["ai-replies"], [record()]))


def test_a_record_carries_its_open_breakers_and_reads_a_newer_or_older_layout() -> None:
    written = record(last_beat_s=0.0, breakers={"ai-replies": "open"})
    document = json.loads(written.to_json())
    assert document["breakers"] == {"ai-replies": "open"}
    assert WorkerRecord.from_json(written.to_json()) == written
    # A newer worker's field is left out; an older one's record lacks breakers: closed.
    assert WorkerRecord.from_json(json.dumps({**document, "later": 1})) == written
    del document["breakers"]
    older = WorkerRecord.from_json(json.dumps(document))
    assert older is not None and older.breakers == {}


@pytest.mark.parametrize(
    "text", ["", "nonsense", "[]", '{"v": 2, "worker_id": "w"}', '{"v": 1, "worker_id": "w"}']
)
def test_a_record_of_another_layout_is_skipped_not_an_error(text: str) -> None:
    assert WorkerRecord.from_json(text) is None


class _NoRedis:
    def register_script(self, text: str) -> None:
        return None


def beat(cancels: Cancels, concurrency: int) -> Beat:
    return Beat(
        WorkerRegistry(_NoRedis()),  # type: ignore[arg-type]  # record() writes nothing
        worker_id="w1",
        app="demo",
        queues=["q"],
        concurrency=concurrency,
        cancels=cancels,
        state=lambda: "consuming",
        interval_s=2.0,
        leave_timeout_s=1.0,
    )


async def test_a_beat_lists_the_longest_running_up_to_the_concurrency_and_counts_the_rest() -> None:
    cancels, deadlines = Cancels(), Deadlines()
    waiting = cancels.watch("q", "not-started", 1)  # its handler waits for a claim: no deadline
    release = asyncio.Event()

    async def handler(task_id: str, attempt: int, started: asyncio.Event) -> None:
        watch = cancels.watch("q", task_id, attempt)
        with deadlines.within(60) as deadline:
            watch.attach(deadline)
            started.set()
            await release.wait()

    started = asyncio.Event(), asyncio.Event()
    # Started one after the other: the record orders them by their handlers' start.
    first = asyncio.create_task(handler("first", 3, started[0]))
    await started[0].wait()
    second = asyncio.create_task(handler("second", 1, started[1]))
    await started[1].wait()
    try:
        made = beat(cancels, concurrency=2).record()
        everyone = beat(cancels, concurrency=10).record()
    finally:
        release.set()
        await asyncio.gather(first, second)
        cancels.unwatch(waiting)

    assert [(t.task_id, t.attempt) for t in made.tasks] == [("first", 3), ("second", 1)]
    assert (made.in_flight, made.more) == (3, 1)
    assert made.tasks[0].running_s is not None and made.tasks[1].running_s is not None
    assert made.tasks[0].running_s >= made.tasks[1].running_s >= 0
    assert [t.task_id for t in everyone.tasks] == ["first", "second", "not-started"]
    assert everyone.tasks[-1].running_s is None and everyone.more == 0
    assert (made.ttl_s, made.beat_s, made.state, made.queues) == (6.0, 2.0, "consuming", ("q",))
    assert made.uptime_s >= 0 and made.pid > 0


def test_a_record_never_lists_more_than_the_hard_cap() -> None:
    cancels = Cancels()
    for n in range(LISTED_TASKS_MAX + 5):
        cancels.watch("q", f"t{n}")

    made = beat(cancels, concurrency=10_000).record()

    assert (len(made.tasks), made.more) == (LISTED_TASKS_MAX, 5)

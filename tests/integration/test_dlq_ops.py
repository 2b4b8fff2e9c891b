"""The DLQ ops tools on the real broker and Redis: look without taking, shovel back, export,
purge, queue depths; for dead letters of our worker and of RabbitMQ itself; and the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import next_message, outcome_count, queue_depth, wait_until
from tests.integration.processes import FIXTURE_APP, one_error_line, run_cli, settings_env
from weclaw_mq import App, Context, RetryPolicy, TaskStatus
from weclaw_mq.admin import dlq, queue_stats
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name, ladder_queue_name, lane_queue_name
from weclaw_mq.policy.delays import STEP_DELAYS_MS

FAIL_ONCE_MORE = RetryPolicy(max_retries=1, delay_s=0.05)  # attempts 1 and 2, then the DLQ


class Prompt(BaseModel):
    text: str


@dataclass
class Call:
    task_id: str
    attempt: int
    headers: dict[str, Any]


@dataclass
class DeadLettered:
    """Three tasks that a failing handler sent to the DLQ; its worker keeps running."""

    app: App
    queue: str
    task_ids: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    fixed: bool = False  # flip to make the handler succeed from then on

    def calls_of(self, task_id: str) -> list[Call]:
        return [c for c in self.calls if c.task_id == task_id]


@pytest.fixture
async def dead(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> DeadLettered:
    app = make_app()
    state = DeadLettered(app, qname)

    @app.handler(qname, retry=FAIL_ONCE_MORE)
    async def summarise(task: Prompt, ctx: Context) -> dict[str, str]:
        state.calls.append(Call(ctx.task_id, ctx.attempt, dict(ctx.headers)))
        if not state.fixed:
            raise RuntimeError(f"model down for {task.text}")
        return {"summary": task.text.upper()}

    await start_worker(app)
    for i in range(3):
        task_id = await app.publish(qname, Prompt(text=f"doc-{i}"), trace_id=f"trace-{i}")
        state.task_ids.append(task_id)
    # Counted only after the DLQ copy was confirmed and the source acked.
    await wait_until(lambda: outcome_count(app, qname, "dead_lettered") == 3, 15, "3 dead letters")
    return state


async def test_inspect_shows_each_dead_letter_with_its_reason_and_error_and_leaves_it_there(
    dead: DeadLettered, amqp: AbstractChannel
) -> None:
    letters = await dlq.inspect(dead.app, dead.queue)

    assert sorted(d.task_id for d in letters) == sorted(dead.task_ids)
    for d in letters:
        i = dead.task_ids.index(d.task_id)
        assert d.reason == "retries_exhausted"
        assert d.error_type == "RuntimeError"
        assert d.error_message == f"model down for doc-{i}"
        assert d.traceback is not None and f"RuntimeError: model down for doc-{i}" in d.traceback
        assert d.attempts == 2
        assert d.original_queue == dead.queue
        assert d.trace_id == f"trace-{i}"
        assert Prompt.model_validate_json(d.body) == Prompt(text=f"doc-{i}")
        assert d.first_failure_at is not None and d.last_failure_at is not None
        assert d.first_failure_at < d.last_failure_at  # two failures, one delay apart
        assert not d.by_broker
    # Nothing was taken: the broker has all three, and the next look sees them again at once.
    assert await queue_depth(amqp, dlq_name(dead.queue)) == 3
    again = await dlq.inspect(dead.app, dead.queue)
    assert sorted(d.task_id for d in again) == sorted(dead.task_ids)
    assert len(await dlq.inspect(dead.app, dead.queue, limit=2)) == 2
    assert await queue_depth(amqp, dlq_name(dead.queue)) == 3


async def test_requeue_by_task_id_moves_only_that_task_and_the_fixed_handler_succeeds(
    dead: DeadLettered, amqp: AbstractChannel
) -> None:
    chosen, *rest = dead.task_ids
    dead.fixed = True

    moved = await dlq.requeue(dead.app, dead.queue, task_ids=[chosen])

    assert moved == 1
    state = await dead.app.result(chosen, timeout_s=10)
    assert state.status is TaskStatus.SUCCEEDED
    assert state.result == {"summary": "DOC-0"}
    rerun = dead.calls_of(chosen)[-1]
    assert rerun.attempt == 1  # a fresh start, not attempt 3
    assert rerun.headers[h.REQUEUED] == 1
    assert rerun.headers[h.TRACE_ID] == "trace-0"
    assert h.ERROR_TYPE not in rerun.headers and h.DEAD_LETTER_REASON not in rerun.headers
    # the other two are still in the DLQ, untouched
    left = await dlq.inspect(dead.app, dead.queue)
    assert sorted(d.task_id for d in left) == sorted(rest)
    assert all(d.reason == "retries_exhausted" for d in left)
    assert all(len(dead.calls_of(t)) == 2 for t in rest)

    assert await dlq.requeue(dead.app, dead.queue) == 2

    for task_id in rest:
        assert (await dead.app.result(task_id, timeout_s=10)).status is TaskStatus.SUCCEEDED
    assert await queue_depth(amqp, dlq_name(dead.queue)) == 0


async def test_requeue_records_queued_so_a_waiter_never_sees_the_old_dead_lettered_state(
    dead: DeadLettered,
) -> None:
    before = await dead.app.status(dead.task_ids[0])
    assert before is not None and before.status is TaskStatus.DEAD_LETTERED
    # The handler stays broken: the task dies again, and result() must report THAT death.
    seen_before = len(dead.calls_of(dead.task_ids[0]))

    assert await dlq.requeue(dead.app, dead.queue, task_ids=[dead.task_ids[0]]) == 1

    state = await dead.app.result(dead.task_ids[0], timeout_s=10)
    assert state.status is TaskStatus.DEAD_LETTERED
    assert len(dead.calls_of(dead.task_ids[0])) == seen_before + 2  # ran again: 2 attempts


def _dead_lettered(dead: DeadLettered, n: int) -> Callable[[], bool]:
    return lambda: outcome_count(dead.app, dead.queue, "dead_lettered") == n


async def test_a_re_driven_task_that_dies_again_carries_its_re_drive_count_and_time_to_show(
    dead: DeadLettered,
) -> None:
    task_id = dead.task_ids[0]
    before = datetime.now(UTC)

    last_requeued_at = before
    for trip in (1, 2):
        assert await dlq.requeue(dead.app, dead.queue, task_ids=[task_id]) == 1
        await wait_until(_dead_lettered(dead, 3 + trip), 10, f"re-death {trip}")
        # The handler saw the trip in its headers, and the new death kept them.
        assert dead.calls_of(task_id)[-1].headers[h.REQUEUED] == trip
        again = await dlq.find(dead.app, dead.queue, task_id)
        assert again is not None and again.requeued == trip
        assert again.last_requeued_at is not None and again.last_requeued_at >= last_requeued_at
        assert again.reason == "retries_exhausted" and again.attempts == 2
        last_requeued_at = again.last_requeued_at

    shown = await run_cli("dlq", "show", dead.queue, task_id, env=settings_env(dead.app.settings))
    assert shown.code == 0, shown.stderr
    assert "requeued: 2" in shown.stdout.splitlines()
    assert f"last_requeued_at: {last_requeued_at.isoformat()}" in shown.stdout


async def test_requeue_of_a_task_id_not_in_the_dlq_moves_nothing_and_keeps_the_others(
    dead: DeadLettered, amqp: AbstractChannel
) -> None:
    assert await dlq.requeue(dead.app, dead.queue, task_ids=["no-such-task"]) == 0
    assert await dlq.requeue(dead.app, dead.queue, limit=1) == 1

    await wait_until(
        lambda: outcome_count(dead.app, dead.queue, "dead_lettered") == 4, 10, "re-death"
    )
    assert await queue_depth(amqp, dlq_name(dead.queue)) == 3


async def test_export_writes_one_json_line_per_dead_letter_and_purge_empties_the_dlq(
    dead: DeadLettered, amqp: AbstractChannel, tmp_path: Path
) -> None:
    path = tmp_path / "dead.jsonl"

    assert await dlq.export(dead.app, dead.queue, path) == 3

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["task_id"] for r in records) == sorted(dead.task_ids)
    for r in records:
        i = dead.task_ids.index(r["task_id"])
        assert r["reason"] == "retries_exhausted"
        assert r["error_type"] == "RuntimeError"
        assert r["attempts"] == 2
        # A JSON body is exported as the JSON value itself (jq reads it as an object); the
        # producer's compact bytes need no exact copy beside it.
        assert r["body_encoding"] == "json" and "body_bytes" not in r
        assert r["body"] == {"text": f"doc-{i}"}
        assert r["trace_id"] == f"trace-{i}"
        assert r["headers"][h.ORIGINAL_QUEUE] == dead.queue
    assert await queue_depth(amqp, dlq_name(dead.queue)) == 3  # export takes nothing
    assert await dlq.export(dead.app, dead.queue, path, limit=1) == 1
    assert len(path.read_text().splitlines()) == 1

    assert await dlq.purge(dead.app, dead.queue) == 3

    assert await queue_depth(amqp, dlq_name(dead.queue)) == 0
    assert await dlq.inspect(dead.app, dead.queue) == []


async def test_stats_counts_the_queue_its_delay_queues_and_its_dlq_and_reports_missing_absent(
    dead: DeadLettered,
) -> None:
    got = await queue_stats.stats(dead.app, dead.queue, retry_delays_ms=(50, 86_400_000))

    assert got.work.exists and got.work.messages == 0
    assert got.work.consumers is not None and got.work.consumers >= 1  # the running worker
    # The vhost's shared delay queues its tasks wait in; no lanes (no priorities) and no
    # queue of an older version here, so none listed.
    assert [(c.name, c.role, c.exists) for c in got.retries] == [
        (ladder_queue_name(50), "ladder", True),
        (ladder_queue_name(86_400_000), "ladder", False),
    ]
    assert got.lanes == () and got.old == ()
    assert got.retries[1].messages is None
    assert got.dlq.exists and got.dlq.messages == 3 and got.dlq.consumers == 0
    # The policy's delay, then the step queues that serve any other delay (weclaw_mq.policy.delays).
    assert queue_stats.handler_retry_delays_ms(dead.app, dead.queue) == (50, *STEP_DELAYS_MS)


async def test_message_dead_lettered_by_the_broker_at_its_delivery_limit_is_listed_and_requeued(
    make_app: Callable[..., App], qname: str, amqp: AbstractChannel
) -> None:
    app = make_app()

    @app.handler(qname, delivery_limit=1)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in this test")

    await app.declare()
    task_id = await app.publish(qname, Prompt(text="crash loop"), trace_id="trace-loop")
    # A consumer that dies on the message, twice: each return counts one delivery, and past
    # the limit of 1 the quorum queue itself dead-letters it.
    for _ in range(2):
        message = await next_message(amqp, qname, no_ack=False)
        assert message.message_id == task_id
        await message.nack(requeue=True)
    await wait_until(
        lambda: queue_depth(amqp, dlq_name(qname)), 10, "the broker to dead-letter the message"
    )

    [letter] = await dlq.inspect(app, qname)

    assert letter.task_id == task_id
    assert letter.reason == "delivery_limit"
    assert letter.by_broker
    assert letter.original_queue == qname
    assert letter.error_type is None and letter.error_message is None
    assert letter.attempts == 1
    assert letter.trace_id == "trace-loop"
    assert letter.last_failure_at is not None
    assert h.X_DEATH in letter.headers

    assert await dlq.requeue(app, qname) == 1

    copy = await next_message(amqp, qname)
    assert copy.message_id == task_id
    headers = dict(copy.headers or {})
    assert not [k for k in headers if k.startswith(("x-death", "x-first-death-"))], headers
    assert headers[h.ATTEMPT] == 1 and headers[h.REQUEUED] == 1
    assert headers[h.TRACE_ID] == "trace-loop"
    assert Prompt.model_validate_json(copy.body) == Prompt(text="crash loop")


# -- the CLI, as the installed script ------------------------------------------------------


async def test_cli_lists_shows_requeues_and_purges_and_refuses_to_purge_without_yes(
    dead: DeadLettered, amqp: AbstractChannel
) -> None:
    env = settings_env(dead.app.settings)
    q = dead.queue

    listed = await run_cli("dlq", "list", q, env=env)

    assert listed.code == 0, listed.stderr
    header, *rows = listed.stdout.strip().splitlines()
    assert header.split() == ["TASK_ID", "REASON", "ERROR_TYPE", "ATTEMPTS", "LAST_FAILURE"]
    assert sorted(r.split()[0] for r in rows) == sorted(dead.task_ids)
    assert all(r.split()[1:4] == ["retries_exhausted", "RuntimeError", "2"] for r in rows)

    shown = await run_cli("dlq", "show", q, dead.task_ids[1], env=env)
    assert shown.code == 0, shown.stderr
    assert "reason: retries_exhausted" in shown.stdout
    assert "RuntimeError: model down for doc-1" in shown.stdout.split("traceback:")[1]

    dead.fixed = True
    requeued = await run_cli("dlq", "requeue", q, "--task-id", dead.task_ids[0], env=env)
    assert requeued.code == 0, requeued.stderr
    assert requeued.stdout.startswith("moved 1 message(s)"), requeued.stdout
    state = await dead.app.result(dead.task_ids[0], timeout_s=10)
    assert state.status is TaskStatus.SUCCEEDED

    refused = await run_cli("dlq", "purge", q, env=env)
    assert "--yes" in one_error_line(refused)
    assert await queue_depth(amqp, dlq_name(q)) == 2

    purged = await run_cli("dlq", "purge", q, "--yes", env=env)
    assert purged.code == 0, purged.stderr
    assert purged.stdout.startswith("purged 2 message(s)"), purged.stdout
    assert await queue_depth(amqp, dlq_name(q)) == 0


async def test_cli_stats_prints_the_queue_the_apps_delay_queues_and_the_dlq(
    dead: DeadLettered, tmp_path: Path
) -> None:
    q = dead.queue
    # The fixture app's handler takes its retry options from settings: the same 50 ms delay.
    env = {
        **settings_env(dead.app.settings),
        "WECLAW_MQ_MAX_RETRIES": "1",
        "WECLAW_MQ_RETRY_DELAY_S": "0.05",
        "TEST_QUEUE": q,
        "TEST_RECORD_DIR": str(tmp_path),
    }

    result = await run_cli("stats", q, "--app", FIXTURE_APP, env=env)

    assert result.code == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.strip().splitlines()[1:]}
    # The running worker (the fixture's handler, which takes no priorities) consumes Q; the
    # app given takes priorities, so its lanes are listed, absent.
    consumers = {name: row.pop() for name, row in rows.items()}
    high, urgent = lane_queue_name(q, "high"), lane_queue_name(q, "urgent")
    # The shared ladder's counts are every handler's (other tests' too): role only.
    ladder = {ladder_queue_name(delay) for delay in (50, *STEP_DELAYS_MS)}
    assert {name: row[0] for name, row in rows.items() if name in ladder} == dict.fromkeys(
        ladder, "ladder"
    )
    assert {name: row for name, row in rows.items() if name not in ladder} == {
        q: ["work", "0"],
        high: ["lane", "absent"],
        urgent: ["lane", "absent"],
        dlq_name(q): ["dlq", "3"],
    }
    assert int(consumers[q]) >= 1 and consumers[high] == consumers[urgent] == "-"
    assert consumers[dlq_name(q)] == "0"

    unknown = await run_cli("stats", "t-no-such-queue-for-stats", "--app", FIXTURE_APP, env=env)
    assert "has no handler" in one_error_line(unknown)

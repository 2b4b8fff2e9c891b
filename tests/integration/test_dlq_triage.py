"""Dead-letter triage on a real DLQ, through the installed ``weclaw-mq`` script: filters select
exactly what they say on list, export, requeue and purge; ``--dry-run`` changes nothing; an
export comes back exactly through purge and import; ``stats`` finds a handler's queues from
the broker alone.

The DLQ holds five dead letters of mixed reasons, error types and failure times: four as our
worker writes them, published straight into ``Q.dlq``, and one RabbitMQ itself dead-lettered
at its delivery limit.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import next_message, queue_depth, wait_until
from tests.integration.processes import one_error_line, queue_names, run_cli, settings_env
from tests.integration.test_dlq_inspection import drain, without_delivery_count
from weclaw_mq import App, Limit
from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_filter import DlqFilter
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name
from weclaw_mq.wire.topology import ladder_declarations


class Prompt(BaseModel):
    text: str


def dead_letter(
    task_id: str, reason: str, error_type: str, failed_at: datetime, body: bytes
) -> aio_pika.Message:
    """A dead letter as our worker writes it."""
    return aio_pika.Message(
        body,
        message_id=task_id,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers={
            h.TRACE_ID: f"trace-{task_id}",
            h.ATTEMPT: 1,
            h.DEAD_LETTER_REASON: reason,
            h.ERROR_TYPE: error_type,
            h.ERROR_MESSAGE: f"{task_id} failed",
            h.ORIGINAL_QUEUE: "q",
            h.FIRST_FAILURE_AT: failed_at.isoformat(),
            h.LAST_FAILURE_AT: failed_at.isoformat(),
        },
    )


@dataclass
class MixedDlq:
    app: App
    queue: str
    ids: list[str]  # in queue order
    env: dict[str, str]

    async def order(self) -> list[str]:
        return [d.task_id for d in await dlq.inspect(self.app, self.queue, limit=None)]


@pytest.fixture
async def mixed(make_app: Callable[..., App], qname: str, amqp: AbstractChannel) -> MixedDlq:
    app = make_app()

    @app.handler(qname, delivery_limit=1)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in these tests")

    await app.declare()
    now = datetime.now(UTC)
    ours = [
        # Written before stable error names: matched as "RuntimeError".
        dead_letter(
            "old-runtime",
            "retries_exhausted",
            "builtins.RuntimeError",
            now - timedelta(days=3),
            b'{"text":"a"}',
        ),
        dead_letter(
            "rejected", "rejected", "weclaw_mq.Reject", now - timedelta(hours=2), b'{"text":"b"}'
        ),
        dead_letter(
            "runtime",
            "retries_exhausted",
            "RuntimeError",
            now - timedelta(minutes=10),
            b'{"text": "c"}',
        ),
        dead_letter(
            "invalid",
            "invalid_payload",
            "weclaw_mq.InvalidPayload",
            now - timedelta(minutes=30),
            b"not json at all",
        ),
    ]
    for message in ours:  # aio-pika channels confirm by default
        await amqp.default_exchange.publish(message, routing_key=dlq_name(qname))
    # The fifth: its consumer died on it twice; the quorum queue dead-letters it (now).
    await app.publish(qname, Prompt(text="crash loop"), task_id="loop", trace_id="trace-loop")
    for _ in range(2):
        taken = await next_message(amqp, qname, no_ack=False)
        await taken.nack(requeue=True)
    await wait_until(
        lambda: _depth_is(amqp, dlq_name(qname), 5), 10, "the broker to dead-letter 'loop'"
    )
    ids = ["old-runtime", "rejected", "runtime", "invalid", "loop"]
    return MixedDlq(app, qname, ids, settings_env(app.settings))


async def _depth_is(channel: AbstractChannel, queue: str, n: int) -> bool:
    return await queue_depth(channel, queue) == n


async def listed(mixed: MixedDlq, *filters: str) -> list[str]:
    result = await run_cli("dlq", "list", mixed.queue, "--json", *filters, env=mixed.env)
    assert result.code == 0, result.stderr
    document = json.loads(result.stdout)  # one JSON document
    assert document["total"] == 5 and document["dlq"] == dlq_name(mixed.queue)
    ids = [d["task_id"] for d in document["dead_letters"]]
    assert document["matched"] == len(ids)
    return ids


async def test_filters_select_exactly_the_matching_dead_letters_on_list_export_requeue_purge(
    mixed: MixedDlq, amqp: AbstractChannel
) -> None:
    q = mixed.queue
    assert await listed(mixed, "--error-type", "RuntimeError") == ["old-runtime", "runtime"]
    assert await listed(mixed, "--since", "1h") == ["runtime", "invalid", "loop"]
    assert await listed(mixed, "--until", "1h", "--reason", "rejected") == ["rejected"]
    # The broker's own dead letter is read like ours (the library: the same filter object).
    where = DlqFilter.of(reasons=["delivery_limit"])
    assert [d.task_id for d in await dlq.inspect(mixed.app, q, where=where)] == ["loop"]
    assert await listed(mixed, "-t", "invalid", "-t", "loop", "-t", "absent") == ["invalid", "loop"]

    exported = await run_cli("dlq", "export", q, "-", "--reason", "invalid_payload", env=mixed.env)
    assert exported.code == 0, exported.stderr
    [record] = [json.loads(line) for line in exported.stdout.splitlines()]
    assert record["task_id"] == "invalid"
    assert record["body"] == "not json at all" and record["body_encoding"] == "utf-8"
    assert "exported 1 message(s)" in exported.stderr  # stdout holds only the records

    requeued = await run_cli(
        "dlq",
        "requeue",
        q,
        "--error-type",
        "RuntimeError",
        "--rate",
        "100/s",
        "--progress",
        env=mixed.env,
    )
    assert requeued.code == 0, requeued.stderr
    assert requeued.stdout.startswith("moved 2 message(s)"), requeued.stdout
    assert "skipped 0, failed 0, left 3" in requeued.stdout
    assert "5/5" in requeued.stderr  # the forced progress bar's last state: every one visited
    assert sorted(m.message_id or "" for m in await drain(amqp, q)) == ["old-runtime", "runtime"]
    assert await mixed.order() == ["rejected", "invalid", "loop"]  # the others, in order

    purged = await run_cli("dlq", "purge", q, "--yes", "--reason", "rejected", env=mixed.env)
    assert purged.code == 0, purged.stderr
    assert purged.stdout.startswith("purged 1 message(s)"), purged.stdout
    left = await drain(amqp, dlq_name(q))
    assert [m.message_id for m in left] == ["invalid", "loop"]
    assert all(not m.redelivered for m in left)


async def test_dry_run_of_requeue_and_purge_lists_the_selection_and_changes_nothing(
    mixed: MixedDlq, amqp: AbstractChannel
) -> None:
    q = mixed.queue
    before = await dlq.inspect(mixed.app, q, limit=None)
    depths = (await queue_depth(amqp, q), await queue_depth(amqp, dlq_name(q)))

    requeue = await run_cli(
        "dlq",
        "requeue",
        q,
        "--dry-run",
        "--since",
        "1h",
        "--reason",
        "retries_exhausted",
        "--reason",
        "delivery_limit",
        env=mixed.env,
    )
    purge = await run_cli("dlq", "purge", q, "--dry-run", "--until", "1h", env=mixed.env)

    assert requeue.code == 0, requeue.stderr
    assert [line.split()[0] for line in requeue.stdout.splitlines()[1:-1]] == ["runtime", "loop"]
    assert "would move 2 message(s)" in requeue.stdout and "nothing changed" in requeue.stdout
    assert purge.code == 0, purge.stderr  # no --yes needed to look
    assert [line.split()[0] for line in purge.stdout.splitlines()[1:-1]] == [
        "old-runtime",
        "rejected",
    ]
    assert "would purge 2 message(s)" in purge.stdout
    # Nothing moved, nothing removed, the order and every message as before.
    assert (await queue_depth(amqp, q), await queue_depth(amqp, dlq_name(q))) == depths == (0, 5)
    after = await dlq.inspect(mixed.app, q, limit=None)
    assert [d.task_id for d in after] == mixed.ids
    for old, new in zip(before, after, strict=True):
        assert new.body == old.body
        assert without_delivery_count(new.headers) == without_delivery_count(old.headers)


async def test_purge_with_a_limit_deletes_at_most_that_many_oldest_first(mixed: MixedDlq) -> None:
    q = mixed.queue
    dry = await run_cli("dlq", "purge", q, "--dry-run", "--limit", "2", env=mixed.env)
    assert dry.code == 0, dry.stderr
    assert "would purge 2 message(s)" in dry.stdout and "would leave 3" in dry.stdout
    # No filter but a limit: never the whole-queue purge.
    purged = await run_cli("dlq", "purge", q, "--yes", "--limit", "2", env=mixed.env)
    assert purged.code == 0, purged.stderr
    assert purged.stdout.startswith("purged 2 message(s)"), purged.stdout
    assert await mixed.order() == ["runtime", "invalid", "loop"]
    filtered = await run_cli("dlq", "purge", q, "--yes", "-n", "1", "--since", "1h", env=mixed.env)
    assert filtered.stdout.startswith("purged 1 message(s)"), filtered.stdout
    assert await mixed.order() == ["invalid", "loop"]


async def test_export_purge_import_export_gives_back_the_same_records(
    mixed: MixedDlq, amqp: AbstractChannel, tmp_path: Path
) -> None:
    q = mixed.queue
    exported = await run_cli("dlq", "export", q, "-", env=mixed.env)
    assert exported.code == 0, exported.stderr
    first = [json.loads(line) for line in exported.stdout.splitlines()]
    assert [r["task_id"] for r in first] == mixed.ids
    assert first[0]["body"] == {"text": "a"}  # a JSON body as an object
    assert "body_bytes" in first[2]  # '{"text": "c"}' has a space compact JSON would drop
    path = tmp_path / "dead.jsonl"
    path.write_text(exported.stdout)

    assert await dlq.purge(mixed.app, q) == 5
    imported = await run_cli("dlq", "import", q, str(path), env=mixed.env)

    assert imported.code == 0, imported.stderr
    assert imported.stdout.startswith("imported 5 message(s)"), imported.stdout
    again = tmp_path / "again.jsonl"
    assert await dlq.export(mixed.app, q, again) == 5
    assert [json.loads(line) for line in again.read_text().splitlines()] == first
    copies = await drain(amqp, dlq_name(q))
    assert copies[2].body == b'{"text": "c"}'  # byte for byte
    assert copies[4].headers is not None and h.X_DEATH in copies[4].headers  # the broker's own


async def test_a_damaged_export_imports_nothing_and_says_which_line(
    mixed: MixedDlq, amqp: AbstractChannel, tmp_path: Path
) -> None:
    path = tmp_path / "dead.jsonl"
    assert await dlq.export(mixed.app, mixed.queue, path, limit=2) == 2
    path.write_text(path.read_text() + '{"task_id": "x", "body": 1}\n')

    result = await run_cli("dlq", "import", mixed.queue, str(path), env=mixed.env)

    assert "line 3" in one_error_line(result) and result.code == 2
    assert await queue_depth(amqp, dlq_name(mixed.queue)) == 5


async def test_properties_the_broker_would_refuse_import_nothing_and_the_fixed_file_imports_once(
    mixed: MixedDlq, amqp: AbstractChannel, tmp_path: Path
) -> None:
    path = tmp_path / "dead.jsonl"
    assert await dlq.export(mixed.app, mixed.queue, path, limit=2) == 2
    good = path.read_text()
    damaged = json.loads(good.splitlines()[0])
    # A headers table with a field type RabbitMQ does not know: it closes the connection
    # (INTERNAL_ERROR) on such a publish, after the lines before it went in.
    table = b"\x01kZ"
    raw = struct.pack(">H", 0x2000) + struct.pack(">I", len(table)) + table
    damaged["amqp_properties"] = base64.b64encode(raw).decode()
    path.write_text(good + json.dumps(damaged) + "\n")

    refused = await run_cli("dlq", "import", mixed.queue, str(path), env=mixed.env)

    line = one_error_line(refused)
    assert refused.code == 2, (refused.code, line)
    assert "line 3" in line and "field type b'Z'" in line and "nothing imported" in line, line
    assert await queue_depth(amqp, dlq_name(mixed.queue)) == 5
    path.write_text(good)
    fixed = await run_cli("dlq", "import", mixed.queue, str(path), env=mixed.env)
    assert fixed.code == 0, fixed.stderr
    assert await queue_depth(amqp, dlq_name(mixed.queue)) == 7  # each good line once


async def test_stats_without_app_finds_the_lanes_and_delay_queues_of_a_limited_handler(
    make_app: Callable[..., App], qname: str
) -> None:
    app = make_app()

    @app.handler(qname, limit=Limit(concurrency=2))  # the limit ladder's delay queues too
    async def limited(task: Prompt) -> None:
        return None

    await app.declare()
    env = settings_env(app.settings)

    result = await run_cli("stats", qname, "--json", env=env)

    assert result.code == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    assert document["queue"] == qname
    found = {q["name"]: q for q in document["queues"]}
    # Exactly the queues the library declared for this handler (no priorities: no lanes) and
    # the vhost's delay queues it uses: none missed, none invented.
    spec = app.handlers[qname].queue_spec()
    ladder = [name for name, _ in ladder_declarations([spec])][1:]  # not the parking queue
    assert sorted(found) == sorted([*queue_names(app), *ladder])
    assert {q["role"] for q in found.values()} == {"work", "ladder", "dlq"}
    assert all(q["exists"] for q in found.values())
    # The shared ones count other tests' tasks too: only the handler's own are ours.
    own = [found[name] for name in queue_names(app)]
    assert all(q["ready"] == 0 and q["consumers"] == 0 for q in own)

    missing = await run_cli("stats", f"{qname}-absent", env=env)
    assert "no queue named" in one_error_line(missing)
    assert missing.code == 3

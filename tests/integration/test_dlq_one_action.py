"""One DLQ action object (``admin.dlq_action.DlqAction``) behind every front end, on a real
DLQ: a console purge and a CLI purge with the same filter and limit each remove exactly the
dead letters their preview listed, however many matching ones arrive between the preview and
the confirmation; a console preview that listed none removes none."""

from __future__ import annotations

from collections.abc import Callable

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.integration.processes import run_cli, settings_env
from weclaw_mq import App
from weclaw_mq.admin import dlq
from weclaw_mq.admin.dlq_filter import DlqFilter
from weclaw_mq.console import dead_letters
from weclaw_mq.console.dead_letters import DeadLetters
from weclaw_mq.contract import headers as h
from weclaw_mq.contract.naming import dlq_name


class Prompt(BaseModel):
    text: str


async def dead_letter(amqp: AbstractChannel, queue: str, task_id: str, reason: str) -> None:
    message = aio_pika.Message(
        b'{"text":"x"}',
        message_id=task_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers={h.DEAD_LETTER_REASON: reason},
    )
    await amqp.default_exchange.publish(message, routing_key=dlq_name(queue))


@pytest.fixture
async def dlq_app(make_app: Callable[..., App], qname: str) -> App:
    app = make_app()

    @app.handler(qname)
    async def never_runs(task: Prompt) -> None:
        raise AssertionError("no worker runs in these tests")

    await app.declare()
    return app


async def left_in(app: App, queue: str) -> list[str]:
    return [d.task_id for d in await dlq.inspect(app, queue, limit=None)]


async def test_a_console_purge_and_a_cli_purge_remove_exactly_what_their_previews_listed(
    dlq_app: App, qname: str, amqp: AbstractChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over this many, a console run goes by its filter and the count previewed (the path
    # whose limit was once lost): 2 stands for the 1,000 of a real console.
    monkeypatch.setattr(dead_letters, "EXACT_MAX", 2)
    for n in range(5):
        await dead_letter(amqp, qname, f"rejected-{n}", "rejected")
        await dead_letter(amqp, qname, f"expired-{n}", "expired")
    env = settings_env(dlq_app.settings)
    same = ("--reason", "rejected", "--limit", "3")

    dry = await run_cli("dlq", "purge", qname, "--dry-run", *same, env=env)
    assert dry.code == 0, dry.stderr
    cli_listed = [line.split()[0] for line in dry.stdout.splitlines()[1:-1]]
    await dead_letter(amqp, qname, "rejected-late-cli", "rejected")
    done = await run_cli("dlq", "purge", qname, "--yes", *same, env=env)
    assert done.code == 0, done.stderr
    assert cli_listed == ["rejected-0", "rejected-1", "rejected-2"]
    assert done.stdout.startswith("purged 3 message(s)"), done.stdout

    engine = DeadLetters(dlq_app)
    preview, selected = await engine.preview("purge", qname, DlqFilter.of(reasons=["rejected"]))
    console_listed = [d.task_id for d in selected]
    assert not preview.exact and preview.planned().limit == 3  # the CLI's limit
    await dead_letter(amqp, qname, "rejected-late-console", "rejected")
    job = engine.start(preview.id)
    await engine.wait()
    assert job.state == "done", job.error
    assert console_listed == ["rejected-3", "rejected-4", "rejected-late-cli"]
    assert job.summary["removed"] == 3

    left = await left_in(dlq_app, qname)
    assert not set(left) & {*cli_listed, *console_listed}
    assert left == [*(f"expired-{n}" for n in range(5)), "rejected-late-console"]


async def test_a_confirmed_console_preview_of_nothing_removes_nothing(
    dlq_app: App, qname: str, amqp: AbstractChannel
) -> None:
    engine = DeadLetters(dlq_app)
    await dead_letter(amqp, qname, "expired-0", "expired")
    preview, selected = await engine.preview("purge", qname, DlqFilter.of(reasons=["rejected"]))
    assert selected == [] and preview.planned().limit == 0
    await dead_letter(amqp, qname, "rejected-late", "rejected")  # matches, but came after

    job = engine.start(preview.id)
    await engine.wait()

    assert job.state == "done", job.error
    assert job.summary["removed"] == 0
    assert await left_in(dlq_app, qname) == ["expired-0", "rejected-late"]

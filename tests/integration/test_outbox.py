"""The local outbox, quick cases: a dead endpoint (nothing answers on a closed port) stands in
for the broker being down, the shared broker for it being back, real SQLite files in tmp_path.

The slow and disruptive ones (a private node stopped, a memory alarm, kill -9 of a relay)
are in tests/drills/test_outbox_drill.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aio_pika.abc import AbstractChannel
from pydantic import BaseModel

from tests.conftest import forget_task_keys, get_message, queue_depth, settings_for, wait_until
from tests.drills.tcp_proxy import TcpProxy
from tests.integration.conftest import DEAD_URL
from tests.integration.dead_endpoints import closed_port
from weclaw_mq import App, PublishNackedError, TaskStatus
from weclaw_mq.contract.message import build_message
from weclaw_mq.contract.naming import lane_queue_name
from weclaw_mq.errors import OutboxFullError, OutboxUnusableError
from weclaw_mq.outbox import Outbox, OutboxRow
from weclaw_mq.outbox.relay import Relay
from weclaw_mq.outbox.store import OutboxFile


class Job(BaseModel):
    n: int


def with_handler(app: App, queue: str, **options: object) -> App:
    @app.handler(queue, **options)  # type: ignore[arg-type]
    async def work(job: Job) -> int:
        return job.n

    return app


def outbox_rows(path: Path) -> list[tuple[str, str, bytes, bytes]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT queue, task_id, body, properties FROM weclaw_outbox ORDER BY seq"
        ).fetchall()


async def drain(app: App) -> int:
    """Drain ``app``'s outbox once with a relay of the test's own (the app's own relay is off)."""
    outbox = await app.start_outbox()
    relay = Relay(outbox, app.settings, app.metrics, store=app.results)
    try:
        return await relay.drain()
    finally:
        await relay.close()


@pytest.fixture
def dead_app(down_apps: Callable[..., App], qname: str) -> Callable[..., App]:
    """``down_apps`` with ``qname``'s handler."""
    return lambda **overrides: with_handler(down_apps(**overrides), qname, priorities=True)


@pytest.fixture
def down_and_up(
    make_app: Callable[..., App], dead_app: Callable[..., App], tmp_path: Path, qname: str
) -> Callable[..., tuple[App, App]]:
    """Two apps on one outbox file: ``down`` publishes to a closed port, ``up`` (the shared
    broker) declares the queue and relays. Their in-app relays are off: the test drives."""

    def build(**overrides: Any) -> tuple[App, App]:
        common: dict[str, Any] = {
            "outbox_path": str(tmp_path / "outbox.db"),
            "outbox_relay_in_app": False,
        }
        common.update(overrides)
        return dead_app(**common), with_handler(make_app("up", **common), qname, priorities=True)

    return build


async def test_a_publish_with_the_broker_down_is_stored_locally_and_relayed_byte_identical(
    down_and_up: Callable[..., tuple[App, App]], qname: str, amqp: AbstractChannel
) -> None:
    down, up = down_and_up()
    await up.declare()

    ids = [await down.publish(qname, {"n": i}, headers={"tenant": "t1"}) for i in range(5)]
    ids += await down.publish_many(qname, [{"n": i} for i in range(5, 10)])

    for task_id in ids:
        state = await down.status(task_id)
        assert state is not None and state.status is TaskStatus.STORED_LOCALLY
    stored = outbox_rows(Path(str(down.settings.outbox_path)))
    assert [r[1] for r in stored] == ids
    assert await queue_depth(amqp, qname) == 0

    assert await drain(up) == 10

    assert outbox_rows(Path(str(up.settings.outbox_path))) == []
    for queue, task_id, body, properties in stored:
        message = await get_message(amqp, queue)
        assert message is not None
        assert message.message_id == task_id and message.body == body
        sent = OutboxRow(0, queue, task_id, body, properties).amqp_properties()
        # Every property publish set, as built (the broker re-encodes some header types on
        # delivery (and a quorum queue adds x-delivery-count), so decoded values are compared.
        delivered = dict(message.headers)
        delivered.pop("x-delivery-count", None)
        assert delivered == sent.headers
        for name in ("timestamp", "content_type", "delivery_mode", "message_id"):
            assert getattr(message.properties, name) == getattr(sent, name), name
    assert b"tenant" in stored[0][3] and b"tenant" not in stored[-1][3]
    state = await up.status(ids[0])
    assert state is not None and state.status is TaskStatus.QUEUED


async def test_a_task_above_normal_is_relayed_to_its_priority_lane(
    down_and_up: Callable[..., tuple[App, App]], qname: str, amqp: AbstractChannel
) -> None:
    """Publish cannot ask the broker's version while it is down, so the row holds Q: the
    relay routes by the priority header, as publish would have (lanes on this broker)."""
    down, up = down_and_up()
    await up.declare()
    urgent = await down.publish(qname, {"n": 1}, priority="urgent")
    normal = await down.publish(qname, {"n": 2})
    assert [r[0] for r in outbox_rows(Path(str(down.settings.outbox_path)))] == [qname, qname]

    assert await drain(up) == 2

    lane = lane_queue_name(qname, "urgent")
    message = await get_message(amqp, lane)
    assert message is not None and message.message_id == urgent
    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == normal


async def test_status_answers_stored_locally_from_the_outbox_when_redis_is_down(
    tmp_path: Path, qname: str
) -> None:
    settings = settings_for(
        DEAD_URL,
        f"redis://127.0.0.1:{closed_port()}/0",
        redis_timeout_s=0.5,
        outbox_path=str(tmp_path / "o.db"),
        outbox_relay_in_app=False,
    )
    app = with_handler(App("no-redis", settings=settings), qname)
    task_id = await app.publish(qname, {"n": 1})

    try:
        state = await app.status(task_id)
    finally:
        await app.close()

    assert state is not None and state.status is TaskStatus.STORED_LOCALLY
    assert state.queue == qname


async def test_a_nack_raises_and_stores_nothing(
    make_app: Callable[..., App], tmp_path: Path, qname: str
) -> None:
    """A full queue (reject-publish) is the broker saying no: the caller hears it."""
    app = with_handler(make_app(outbox_path=str(tmp_path / "o.db")), qname, max_length=1)
    await app.declare()

    with pytest.raises(PublishNackedError):
        # A quorum queue with max_length=1 may admit a second message (test_publishing).
        for i in range(3):
            await app.publish(qname, {"n": i})

    assert (await (await app.start_outbox()).stats()).rows == 0


async def test_a_full_outbox_refuses_with_a_clear_error_and_a_batch_stores_all_or_nothing(
    down_and_up: Callable[..., tuple[App, App]], qname: str
) -> None:
    down, _ = down_and_up(outbox_max_rows=5)
    await down.publish_many(qname, [{"n": i} for i in range(3)])

    with pytest.raises(OutboxFullError, match=r"outbox is full \(3 rows.*MAX_ROWS=5"):
        await down.publish_many(qname, [{"n": i} for i in range(3)])  # 6 > 5: none of them
    await down.publish(qname, {"n": 4})
    await down.publish(qname, {"n": 5})
    with pytest.raises(OutboxFullError):
        await down.publish(qname, {"n": 6})

    assert len(outbox_rows(Path(str(down.settings.outbox_path)))) == 5


PROBLEMS = {
    "no-directory": "no directory",
    "a-directory": "is a directory",
    "corrupt": "not a readable SQLite database",
    "other-schema": "has outbox schema '99'",
}


def unusable_file(tmp_path: Path, problem: str) -> Path:
    path = tmp_path / "outbox.db"
    if problem == "no-directory":
        blocker = tmp_path / "file"
        blocker.write_text("")
        path = blocker / "outbox.db"
    elif problem == "a-directory":
        path.mkdir()
    elif problem == "corrupt":
        path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    else:
        OutboxFile(path, max_rows=10, max_bytes=10_000).close()
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE weclaw_outbox_meta SET value='99' WHERE key='schema_version'")
    return path


@pytest.mark.parametrize("problem", list(PROBLEMS))
async def test_an_unusable_outbox_file_is_a_clear_error_at_start(
    dead_app: Callable[..., App], tmp_path: Path, problem: str, qname: str
) -> None:
    app = dead_app(outbox_path=str(unusable_file(tmp_path, problem)))

    with pytest.raises(OutboxUnusableError, match=PROBLEMS[problem]):
        await app.start_outbox()
    with pytest.raises(OutboxUnusableError, match=PROBLEMS[problem]):
        await app.publish(qname, {"n": 1})  # never silently sent on, or dropped


@pytest.mark.parametrize("problem", ["corrupt", "no-directory"])
def test_outbox_status_on_an_unusable_file_is_one_error_line(tmp_path: Path, problem: str) -> None:
    path = unusable_file(tmp_path, problem)

    cli = subprocess.run(
        [sys.executable, "-m", "weclaw_mq.cli", "outbox", "status", "--path", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert cli.returncode == 1
    assert cli.stderr.count("\n") == 1 and PROBLEMS[problem] in cli.stderr


def test_outbox_status_of_a_missing_file_is_one_error_line_and_creates_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mistyped.db"

    cli = subprocess.run(
        [sys.executable, "-m", "weclaw_mq.cli", "outbox", "status", "--path", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert cli.returncode == 1, cli.stderr
    assert cli.stderr.count("\n") == 1 and "no outbox file at" in cli.stderr, cli.stderr
    assert not path.exists()  # a look never makes an empty outbox that reads "0 rows"


async def test_the_users_transaction_decides_rolled_back_sends_nothing_committed_sends_once(
    down_and_up: Callable[..., tuple[App, App]], qname: str, amqp: AbstractChannel
) -> None:
    _, up = down_and_up()
    await up.declare()
    await up.start_outbox()  # creates the outbox tables in the file
    path = str(up.settings.outbox_path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")

    conn.execute("BEGIN")
    conn.execute("INSERT INTO orders (item) VALUES ('lost')")
    up.add_to_outbox(conn, qname, {"n": 1})
    conn.execute("ROLLBACK")
    conn.execute("BEGIN")
    conn.execute("INSERT INTO orders (item) VALUES ('kept')")
    kept = up.add_to_outbox(conn, qname, {"n": 2})
    conn.execute("COMMIT")
    conn.close()

    assert await drain(up) == 1
    assert await drain(up) == 0
    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == kept
    assert await queue_depth(amqp, qname) == 0


async def test_two_relays_on_one_file_never_send_a_row_twice(
    down_and_up: Callable[..., tuple[App, App]], qname: str, amqp: AbstractChannel
) -> None:
    down, up = down_and_up(outbox_relay_window=20)
    await up.declare()
    ids = await down.publish_many(qname, [{"n": i} for i in range(300)])
    path = str(up.settings.outbox_path)
    outboxes = [await Outbox.open(path, max_rows=1000, max_bytes=10**7) for _ in range(2)]
    relays = [Relay(o, up.settings, up.metrics) for o in outboxes]
    try:
        sent = await asyncio.gather(*(r.drain() for r in relays))
    finally:
        for r, o in zip(relays, outboxes, strict=True):
            await r.close()
            await o.close()

    assert sum(sent) == len(ids) and min(sent) > 0  # both took part
    assert await queue_depth(amqp, qname) == len(ids)


async def test_a_relay_with_the_broker_down_keeps_every_row(
    down_and_up: Callable[..., tuple[App, App]], qname: str
) -> None:
    down, _ = down_and_up()
    await down.publish_many(qname, [{"n": i} for i in range(50)])

    from weclaw_mq.errors import BrokerUnavailableError

    with pytest.raises(BrokerUnavailableError):
        await drain(down)

    stats = await (await down.start_outbox()).stats()
    assert stats.rows == 50 and stats.claimed == 0  # given back at once, not left claimed


async def test_the_apps_own_relay_sends_what_is_stored_and_reports_it_in_metrics(
    down_and_up: Callable[..., tuple[App, App]], qname: str, amqp: AbstractChannel
) -> None:
    down, up = down_and_up()
    await up.declare()
    ids = await down.publish_many(qname, [{"n": i} for i in range(30)])
    assert down.metrics.registry.get_sample_value(
        "weclaw_mq_outbox_stored_total", {"queue": qname}
    ) == len(ids)
    relaying = with_handler(
        App("relaying", settings=up.settings.model_copy(update={"outbox_relay_in_app": True})),
        f"{qname}-other",  # its own handler: the queue under test is deleted by ``up``
    )
    try:
        await relaying.start_outbox()  # the relay starts with it, and drains
        await wait_until(lambda: outbox_rows(Path(str(up.settings.outbox_path))) == [], 10)
        sample = relaying.metrics.registry.get_sample_value

        # The rows leave the file before the relay counts them (its delete is awaited first),
        # and the gauge reads 0 before its first update: wait for the count, then the gauge.
        await wait_until(
            lambda: sample("weclaw_mq_outbox_relayed_total", {"queue": qname}) == len(ids),
            10,
            "the relayed count",
        )
        await wait_until(lambda: sample("weclaw_mq_outbox_rows") == 0, 10, "the gauge")
        assert await queue_depth(amqp, qname) == len(ids)
    finally:
        await relaying.close()


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weclaw_mq.cli", "outbox", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WECLAW_MQ_RESULTS_ENABLED": "false", **env},
    )


def test_outbox_cli_status_and_relay_say_what_is_waiting_and_why(
    tmp_path: Path, broker_url: str, qname: str
) -> None:
    path = tmp_path / "outbox.db"
    file = OutboxFile(path, max_rows=100, max_bytes=10**6)
    # A queue nobody declared: the relay must keep the row and say why, not drop it.
    file.add([(qname, build_message(b'{"n": 1}', task_id="t-1", headers={}))])
    file.close()

    down = run_cli("relay", "--once", "--path", str(path), WECLAW_MQ_AMQP_URL=DEAD_URL)
    up = run_cli("relay", "--once", "--path", str(path), WECLAW_MQ_AMQP_URL=broker_url)
    status = run_cli("status", "--json", WECLAW_MQ_OUTBOX_PATH=str(path))
    human = run_cli("status", WECLAW_MQ_OUTBOX_PATH=str(path))

    assert down.returncode == 4 and down.stderr.count("\n") == 1, down.stderr
    assert "cannot connect to RabbitMQ" in down.stderr and "guest:guest" not in down.stderr
    assert up.returncode == 0 and "relayed 0 task(s)" in up.stdout, up.stderr
    info = json.loads(status.stdout)
    assert info["rows"] == 1 and info["failing"] == 1 and info["claimed"] == 0
    assert f"unroutable: no queue named {qname!r}" in info["last_error"]
    assert "rows: 1 (bound 100)" in human.stdout and "last send failed: 1 rows" in human.stdout


async def test_the_example_api_answers_202_stored_locally_while_the_broker_is_down(
    redis_url: str, tmp_path: Path, qname: str
) -> None:
    from tests.integration.test_examples import demo_client

    mq = App(
        "demo-api", settings=settings_for(DEAD_URL, redis_url, outbox_path=str(tmp_path / "o.db"))
    )
    try:
        # The lifespan opens the outbox and starts its relay; the declare fails, is logged.
        async with demo_client(mq, qname, lifespan=True) as client:
            posted = await client.post("/tasks", json={"text": "hello"})
            task_id = posted.json()["task_id"]
            seen = await client.get(f"/tasks/{task_id}")
    finally:
        await mq.close()
        await forget_task_keys(redis_url, [qname])

    assert posted.status_code == 202, posted.text
    assert posted.json() == {"task_id": task_id, "status": "stored_locally"}
    assert seen.status_code == 200 and seen.json()["status"] == "stored_locally"


OUTAGE_PUBLISHES = 300


async def test_publishes_while_the_broker_is_down_share_few_connects_and_log_the_outage_once(
    make_app: Callable[..., App],
    tmp_path: Path,
    qname: str,
    broker_url: str,
    amqp: AbstractChannel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = urlsplit(broker_url)
    async with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        common: dict[str, Any] = {
            "outbox_path": str(tmp_path / "outbox.db"),
            "outbox_relay_in_app": False,
            "reconnect_max_delay_s": 2,
        }
        down = with_handler(make_app("down", amqp_url=proxy.url_for(broker_url), **common), qname)
        up = with_handler(make_app("up", **common), qname)
        await up.declare()
        proxy.refuse()  # what a stopped broker's clients see: every connect fails
        caplog.set_level(logging.INFO, logger="weclaw_mq")

        ids = [await down.publish(qname, {"n": i}) for i in range(OUTAGE_PUBLISHES)]

        # One connect per backoff step, not one per publish (there were 300).
        assert 1 <= proxy.accepted <= OUTAGE_PUBLISHES // 10, proxy.accepted
        assert len(outbox_rows(Path(common["outbox_path"]))) == OUTAGE_PUBLISHES
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([w for w in warnings if w.startswith("stored ")]) == 1, warnings
        assert len(warnings) <= 2, warnings

        proxy.pass_traffic()
        later: list[str] = []

        async def confirmed_again() -> bool:
            # Until the next connect is due, a publish still goes to the outbox.
            later.append(await down.publish(qname, {"n": -1}))
            return not await down.stored_locally(later[-1])

        await wait_until(confirmed_again, 10, "a publish to reach the broker again")
        ended = [r.getMessage() for r in caplog.records if "answers again:" in r.getMessage()]
        stored = OUTAGE_PUBLISHES + len(later) - 1
        assert len(ended) == 1 and f"{stored} task(s) were stored" in ended[0], ended
        assert await drain(up) == stored
        assert await queue_depth(amqp, qname) == len(ids) + len(later)

"""The PostgreSQL outbox on the machine's PostgreSQL and the real broker: a task added in the
application's transaction is published exactly when that transaction commits (woken by
NOTIFY, not by a poll), a rollback publishes nothing, relays at once never publish a row twice,
and every connection a web app writes with (psycopg sync and async, SQLAlchemy sync and async,
Django) takes the row."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy
from aio_pika.abc import AbstractChannel
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from tests.conftest import get_message, queue_depth, wait_until
from tests.integration.postgres_db import PgSchema
from tests.integration.processes import run_cli, settings_env
from weclaw_mq import App, ConfigurationError
from weclaw_mq.errors import OutboxUnusableError
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.outbox.postgres import PostgresOutbox, migrate, run_relay
from weclaw_mq.outbox.relay import Relay

MANY = 300
# An idle relay's poll interval here: far longer than any wait below, so only NOTIFY wakes it.
NO_POLL_S = 3600.0


@pytest.fixture
async def outbox(pg_schema: PgSchema) -> PgSchema:
    await migrate(pg_schema.url)
    with pg_schema.connect() as conn:
        conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, item text NOT NULL)")
        conn.commit()
    return pg_schema


@pytest.fixture
async def app(make_app: Callable[..., App], qname: str) -> App:
    app = make_app(outbox_relay_interval_s=NO_POLL_S)

    @app.handler(qname)
    async def summarise(task: dict[str, Any]) -> None:
        return None

    await app.declare()
    return app


class RunningRelay:
    def __init__(self, url: str, app: App) -> None:
        self.url, self.app = url, app
        self.stop = asyncio.Event()
        self.relay: Relay | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Relay:
        store = await PostgresOutbox.open(self.url)
        self.relay = Relay(store, self.app.settings, Metrics())
        self.task = asyncio.create_task(run_relay(self.relay, self.url, self.stop))
        return self.relay

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 30)
        if self.relay is not None:
            await self.relay.outbox.close()


@pytest.fixture
async def relays(outbox: PgSchema, app: App) -> AsyncIterator[Callable[[], Any]]:
    running: list[RunningRelay] = []

    async def start() -> Relay:
        one = RunningRelay(outbox.url, app)
        running.append(one)
        return await one.start()

    yield start
    for one in running:
        await one.close()


async def test_a_task_committed_with_the_order_is_published_after_the_commit_and_only_then(
    outbox: PgSchema, app: App, qname: str, relays: Callable[[], Any], amqp: AbstractChannel
) -> None:
    relay = await relays()
    with outbox.connect() as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders (item) VALUES ('tea')")
            task_id = app.add_to_outbox(conn, qname, {"order": "tea"})
            # Not committed yet: the relay sees no row, the queue gets nothing.
            assert outbox.count() == 0
            await asyncio.sleep(0)  # the relay's loop runs; nothing for it
        # Committed: NOTIFY wakes the relay (its poll interval is an hour).
        await wait_until(lambda: relay.sent == 1, 20, "the relay to publish the committed task")

    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == task_id
    assert json.loads(message.body) == {"order": "tea"}
    assert outbox.count() == 0  # deleted after its confirm


class CommitsDuringThePass(PostgresOutbox):
    """Commits one task after the relay's pass found nothing more, and waits until the
    NOTIFY woke the relay: the moment between a pass's last claim and its wait."""

    def __init__(self, url: str, add: Callable[[], str]) -> None:
        super().__init__(url)
        self.add, self.added = add, ""
        self.relay: Relay | None = None

    async def stats(self) -> Any:
        if not self.added and self.relay is not None and self.relay.sent:
            self.added = await asyncio.to_thread(self.add)
            await wait_until(lambda: self.relay is not None and self.relay._wake.is_set(), 20)
        return await super().stats()


async def test_a_task_committed_while_a_pass_ends_is_sent_without_waiting_for_the_poll(
    outbox: PgSchema, app: App, qname: str, amqp: AbstractChannel
) -> None:
    def commit_one() -> str:
        with outbox.connect() as conn, conn.transaction():
            return app.add_to_outbox(conn, qname, {"order": "late"})

    store = CommitsDuringThePass(outbox.url, commit_one)
    relay = store.relay = Relay(store, app.settings, Metrics())
    stop = asyncio.Event()
    running = asyncio.create_task(run_relay(relay, outbox.url, stop))
    try:
        first = commit_one()
        # The second is committed at the end of the pass that sent the first; the poll
        # interval is an hour, so only the wake it caused can send it.
        await wait_until(lambda: relay.sent == 2, 20, "the late task to be sent")
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await store.close()
    ids = [(await get_message(amqp, qname)).message_id for _ in range(2)]  # type: ignore[union-attr]
    assert ids == [first, store.added]


async def test_a_rolled_back_transaction_publishes_nothing(
    outbox: PgSchema, app: App, qname: str, relays: Callable[[], Any], amqp: AbstractChannel
) -> None:
    relay = await relays()
    with outbox.connect() as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO orders (item) VALUES ('coffee')")
            app.add_to_outbox(conn, qname, {"order": "coffee"})
            raise RuntimeError("the view failed after the insert")
        with conn.transaction():  # a later commit wakes the relay: it finds only this one
            kept = app.add_to_outbox(conn, qname, {"order": "water"})
    await wait_until(lambda: relay.sent == 1, 20, "the relay to publish the committed task")

    assert await queue_depth(amqp, qname) == 1
    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == kept
    with outbox.connect() as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)


async def test_every_kind_of_connection_adds_its_row_in_its_own_transaction(
    outbox: PgSchema, app: App, qname: str
) -> None:
    added: list[str] = []
    async with await psycopg.AsyncConnection.connect(outbox.url) as aconn, aconn.transaction():
        added.append(await app.add_to_outbox(aconn, qname, {"via": "psycopg async"}))
    engine = sqlalchemy.create_engine(outbox.url.replace("postgresql://", "postgresql+psycopg://"))
    with Session(engine) as session, session.begin():
        added.append(app.add_to_outbox(session, qname, {"via": "sqlalchemy session"}))
    with engine.begin() as connection:
        added.append(app.add_to_outbox(connection, qname, {"via": "sqlalchemy connection"}))
    with Session(engine) as session:
        app.add_to_outbox(session, qname, {"via": "rolled back"})
        session.rollback()
    engine.dispose()
    aengine = create_async_engine(outbox.url.replace("postgresql://", "postgresql+psycopg://"))
    async with aengine.begin() as aconnection:
        added.append(await app.add_to_outbox(aconnection, qname, {"via": "sqlalchemy async"}))
    await aengine.dispose()

    with outbox.connect() as conn:
        rows = conn.execute("SELECT task_id FROM weclaw_outbox ORDER BY seq").fetchall()
    assert [r[0] for r in rows] == added


async def test_three_relays_at_once_publish_each_row_exactly_once(
    outbox: PgSchema, app: App, qname: str, relays: Callable[[], Any], amqp: AbstractChannel
) -> None:
    app.settings.outbox_relay_window = 20  # small windows: the relays interleave
    with outbox.connect() as conn, conn.transaction():
        ids = [app.add_to_outbox(conn, qname, {"n": n}) for n in range(MANY)]
    running = [await relays() for _ in range(3)]

    # Counted once each row's delete returned (a relay counts after it): then the table is empty.
    await wait_until(lambda: sum(r.sent for r in running) >= MANY, 60, "the relays to drain")
    assert sum(r.sent for r in running) == MANY
    assert outbox.count() == 0
    assert await queue_depth(amqp, qname) == MANY
    seen = []
    while (message := await get_message(amqp, qname)) is not None:
        seen.append(message.message_id)
    assert sorted(seen) == sorted(ids)


async def test_a_database_without_the_table_says_how_to_create_it(
    pg_schema: PgSchema, app: App, qname: str
) -> None:
    hint = "weclaw-mq outbox migrate --postgres"
    with pg_schema.connect() as conn, pytest.raises(OutboxUnusableError, match=hint):
        app.add_to_outbox(conn, qname, {"n": 1})
    with pytest.raises(OutboxUnusableError, match=hint):
        await PostgresOutbox.open(pg_schema.url)


async def test_a_connection_of_no_known_kind_is_refused(app: App, qname: str) -> None:
    with pytest.raises(ConfigurationError, match="psycopg 3 connection"):
        app.add_to_outbox(object(), qname, {"n": 1})


async def test_the_cli_creates_the_table_relays_it_and_reports_it(
    pg_schema: PgSchema, app: App, qname: str, amqp: AbstractChannel
) -> None:
    env = settings_env(app.settings)
    made = await run_cli("outbox", "migrate", "--postgres", pg_schema.url, env=env)
    assert made.code == 0, made.stderr
    with pg_schema.connect() as conn, conn.transaction():
        task_id = app.add_to_outbox(conn, qname, {"n": 1})
    status = await run_cli("outbox", "status", "--postgres", pg_schema.url, "--json", env=env)
    assert json.loads(status.stdout)["rows"] == 1
    sent = await run_cli("outbox", "relay", "--postgres", pg_schema.url, "--once", env=env)
    assert sent.code == 0, sent.stderr
    assert "relayed 1 task(s)" in sent.stdout
    message = await get_message(amqp, qname)
    assert message is not None and message.message_id == task_id

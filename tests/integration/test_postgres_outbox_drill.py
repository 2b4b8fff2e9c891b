"""Drill: the PostgreSQL outbox's relay dies mid-batch, and so does its database connection.

1000 tasks are committed to the table in one transaction. A standalone relay
(``weclaw-mq outbox relay --postgres``, small windows) is killed with SIGKILL while it holds a
claimed window; a second relay takes over, and PostgreSQL ends every backend of the drill
(``pg_terminate_backend``: the relay's statements and its LISTEN) while it is mid-way. The table
drains; every task id is on the broker, and the copies (rows sent but not yet deleted when a
relay or its connection died) are bounded by the windows in flight. The shared broker is not
touched: only our own processes and our own database backends are ended.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from aio_pika.abc import AbstractChannel

from tests.conftest import get_message, wait_until
from tests.integration.postgres_db import SERVER_URL, PgSchema
from tests.integration.processes import cli_executable, ready_count, settings_env
from weclaw_mq import App
from weclaw_mq.outbox.postgres import migrate
from weclaw_mq.outbox.relay import WINDOWS_IN_FLIGHT

pytestmark = pytest.mark.drill

ROWS = 1000
WINDOW = 5  # small windows: each disruption lands while a window is claimed
CLAIM_S = 2.0  # a dead relay's rows come back this soon


def spawn_relay(app: App, url: str, log: Path) -> subprocess.Popen[bytes]:
    settings = app.settings.model_copy(
        update={
            "outbox_relay_window": WINDOW,
            "outbox_claim_s": CLAIM_S,
            "outbox_relay_interval_s": 0.2,
        }
    )
    env = {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [cli_executable(), "outbox", "relay", "--postgres", url],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def mid_batch(db: PgSchema, relay: subprocess.Popen[bytes], log: Path, below: int) -> None:
    """Wait until fewer than ``below`` rows are left and a window is claimed."""
    deadline = time.monotonic() + 60
    while db.count() >= below or not db.count("WHERE claimed_by IS NOT NULL"):
        assert relay.poll() is None, f"the relay ended; see {log}"
        assert time.monotonic() < deadline, f"the relay did not get below {below} rows in 60 s"
        await asyncio.sleep(0.002)


def end_backends(db: PgSchema) -> int:
    with psycopg.connect(SERVER_URL, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (db.name,),
        ).fetchall()
    return len(rows)


async def test_kill_9_of_the_relay_and_of_its_connection_mid_batch_loses_nothing(
    pg_schema: PgSchema,
    make_app: Callable[..., App],
    qname: str,
    amqp: AbstractChannel,
    broker_url: str,
    tmp_path: Path,
) -> None:
    app = make_app()

    @app.handler(qname)
    async def work(task: dict[str, int]) -> None:
        return None

    await app.declare()
    await migrate(pg_schema.url)
    with pg_schema.connect() as conn, conn.transaction():
        ids = [app.add_to_outbox(conn, qname, {"n": n}) for n in range(ROWS)]
    log = tmp_path / "relay.log"
    relays: list[subprocess.Popen[bytes]] = []
    try:
        relays.append(spawn_relay(app, pg_schema.url, log))
        await mid_batch(pg_schema, relays[0], log, ROWS - 100)
        os.kill(relays[0].pid, signal.SIGKILL)
        relays[0].wait(10)
        left_at_kill = pg_schema.count()
        assert 0 < left_at_kill < ROWS, f"the kill did not land mid-way ({left_at_kill} left)"

        relays.append(spawn_relay(app, pg_schema.url, log))
        await mid_batch(pg_schema, relays[1], log, left_at_kill - 100)
        ended = end_backends(pg_schema)
        assert ended >= 1, "no backend of the relay to end"
        left_at_cut = pg_schema.count()
        assert left_at_cut > 0, "the connection cut did not land mid-way"

        await wait_until(lambda: pg_schema.count() == 0, 90, "the second relay to drain")
        relays[1].send_signal(signal.SIGTERM)
        assert relays[1].wait(30) == 0, log.read_text()
    finally:
        for relay in relays:
            if relay.poll() is None:
                relay.kill()
                relay.wait(10)

    on_broker = await ready_count(broker_url, qname)
    seen: set[str] = set()
    for _ in range(on_broker):
        message = await get_message(amqp, qname)
        assert message is not None
        seen.add(message.message_id or "")
    copies = on_broker - ROWS
    assert seen == set(ids), f"{len(set(ids) - seen)} tasks never reached the broker"
    # Each disruption can repeat at most the windows it had out (sent, not yet deleted).
    assert 0 <= copies <= 2 * WINDOWS_IN_FLIGHT * WINDOW, (copies, left_at_kill, left_at_cut)

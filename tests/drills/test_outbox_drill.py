"""Drills: the local outbox (weclaw_mq.outbox) while the broker cannot take publishes.

1. Node stopped (``stop_app`` on the private node): 200 publishes each return their task id
   at once, with the status ``stored_locally``; once the node is back, the App's own relay
   sends them, and each runs once.
2. kill -9 of a standalone relay (``weclaw-mq outbox relay``) in the middle of 1000 rows,
   then a new relay: nothing lost; the rows the dead relay had sent but not yet deleted are
   sent again (counted on the broker before a worker starts) and the guard absorbs them.
3. Memory alarm: publishes time out waiting for their confirm (outcome unknown) and go to the
   outbox; after the alarm clears they are relayed, and each runs once (a copy the broker
   took in before the timeout is absorbed by the guard).
4. Broker down behind a proxy that counts connects: 1000 publishes go straight to the outbox
   while the producer and its relay share a few connect attempts with backoff (counted),
   the outage is logged once, and once it ends the relay sends them all, each runs once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import settings_for, wait_until
from tests.drills.conftest import DrillRun, RabbitNode, drill_settings
from tests.drills.drill_app import Job
from tests.drills.tcp_proxy import TcpProxy
from tests.integration.dead_endpoints import closed_port
from tests.integration.processes import cli_executable, ready_count, settings_env
from weclaw_mq import App, Settings, TaskStatus
from weclaw_mq.outbox.relay import WINDOWS_IN_FLIGHT

pytestmark = pytest.mark.drill

STOPPED_PUBLISHES = 200
DOWN_PUBLISHES = 1000
# Connects the producer and its relay may make while those publishes last (each backs off
# up to reconnect_max_delay_s): a tenth of one connect per publish, as before.
DOWN_CONNECTS_BOUND = DOWN_PUBLISHES // 10
KILL_ROWS = 1000
KILL_WINDOW = 5  # small windows: the relay is still mid-way when the drill kills it
ALARM_PUBLISHES = 20
ALARM_CONFIRM_TIMEOUT_S = 2.0
CLAIM_S = 2.0  # a killed relay's rows come back this soon


def outbox_count(path: Path, *, claimed: bool = False) -> int:
    where = " WHERE claimed_by IS NOT NULL" if claimed else ""
    with sqlite3.connect(path) as conn:
        return int(conn.execute(f"SELECT count(*) FROM weclaw_outbox{where}").fetchone()[0])


def worker_settings(settings: Settings) -> Settings:
    """The worker never publishes to the outbox: it runs without one."""
    return settings.model_copy(update={"outbox_path": None})


async def test_publishes_while_the_node_is_stopped_are_stored_locally_then_each_runs_once(
    node: RabbitNode,
    drill_redis_url: str,
    new_drill_run: Callable[[str, Settings], DrillRun],
    tmp_path: Path,
) -> None:
    path = tmp_path / "outbox.db"
    settings = drill_settings(
        node.url, drill_redis_url, outbox_path=str(path), outbox_relay_interval_s=0.2
    )
    run = new_drill_run("outbox-stopped", settings)
    ids = run.task_ids(STOPPED_PUBLISHES)
    try:
        await run.app.declare()
        await node.stop_app()
        started = time.perf_counter()
        returned = [
            await run.app.publish(run.queue, Job(n=i), task_id=t) for i, t in enumerate(ids)
        ]
        publish_s = time.perf_counter() - started
        statuses = {(await run.app.status(t)).status for t in ids}  # type: ignore[union-attr]

        assert returned == ids
        assert statuses == {TaskStatus.STORED_LOCALLY}
        assert outbox_count(path) == STOPPED_PUBLISHES
        assert await ready_count_or_none(node) is None, "the node answered while stopped"

        await node.start_app()
        await run.start_worker(concurrency=8, settings=worker_settings(settings))
        await wait_until(lambda: outbox_count(path) == 0, 60, "the app's relay to drain")
        exit_code, stuck = await run.finish(node, ids)
        row = run.report(
            "outbox: 200 publishes while the node is stopped",
            published=STOPPED_PUBLISHES,
            confirmed=set(ids),
            notes=f"all returned stored_locally in {publish_s:.1f} s; relayed by the App",
        )
        run.assert_clean(row, exit_code, stuck)
    finally:
        await run.clean_up(node)


async def ready_count_or_none(node: RabbitNode) -> int | None:
    try:
        return await ready_count(node.url, "amq.nonexistent.probe")
    except Exception:
        return None


def spawn_relay(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        relay = subprocess.Popen(
            [cli_executable(), "outbox", "relay"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    # For the safety nets of tests/private_servers.py: it must not outlive pytest either.
    log.with_suffix(f".{relay.pid}.pid").write_text(str(relay.pid))
    return relay


async def test_kill_9_of_the_relay_mid_way_loses_nothing_and_the_copies_are_absorbed(
    node: RabbitNode,
    drill_redis_url: str,
    new_drill_run: Callable[[str, Settings], DrillRun],
    tmp_path: Path,
) -> None:
    path = tmp_path / "outbox.db"
    settings = drill_settings(
        node.url,
        drill_redis_url,
        outbox_path=str(path),
        outbox_relay_in_app=False,
        outbox_relay_window=KILL_WINDOW,
        outbox_claim_s=CLAIM_S,
        outbox_relay_interval_s=0.2,
    )
    run = new_drill_run("outbox-kill9", settings)
    ids = run.task_ids(KILL_ROWS)
    # The rows come from a producer whose broker is down (a closed port).
    filler = App(
        "filler",
        settings=settings_for(
            f"amqp://guest:guest@127.0.0.1:{closed_port()}/",
            drill_redis_url,
            outbox_path=str(path),
            outbox_relay_in_app=False,
        ),
    )
    relays: list[subprocess.Popen[bytes]] = []
    try:
        await run.app.declare()
        assert (
            await filler.publish_many(run.queue, [Job(n=i) for i in range(KILL_ROWS)], task_ids=ids)
            == ids
        )
        assert outbox_count(path) == KILL_ROWS

        relays.append(spawn_relay(settings, tmp_path / "relay.log"))
        deadline = time.monotonic() + 60
        # Polled tightly: the kill must land mid-way, best while a window is claimed (sent,
        # or being sent, and not yet deleted).
        while outbox_count(path) > KILL_ROWS - 100 or not outbox_count(path, claimed=True):
            assert relays[0].poll() is None, (tmp_path / "relay.log").read_text()
            assert time.monotonic() < deadline, "the relay sent nothing within 60 s"
            await asyncio.sleep(0.002)
        os.kill(relays[0].pid, signal.SIGKILL)
        relays[0].wait(10)
        left_at_kill = outbox_count(path)
        assert 0 < left_at_kill < KILL_ROWS, f"the kill did not land mid-way ({left_at_kill} left)"

        relays.append(spawn_relay(settings, tmp_path / "relay.log"))
        await wait_until(lambda: outbox_count(path) == 0, 60, "the second relay to drain")
        relays[1].send_signal(signal.SIGTERM)
        assert relays[1].wait(30) == 0, (tmp_path / "relay.log").read_text()
        on_broker = await ready_count(node.url, run.queue)
        copies = on_broker - KILL_ROWS

        await run.start_worker(concurrency=8, settings=worker_settings(settings))
        exit_code, stuck = await run.finish(node, ids, run_within_s=90)
        row = run.report(
            "outbox: kill -9 of the relay mid-way through 1000 rows",
            published=KILL_ROWS,
            confirmed=set(ids),
            notes=f"{left_at_kill} rows left at the kill; {copies} sent twice, absorbed by "
            "the guard",
        )
        assert copies >= 0, f"{-copies} rows never reached the broker"
        assert copies <= WINDOWS_IN_FLIGHT * KILL_WINDOW, "more copies than the windows in flight"
        run.assert_clean(row, exit_code, stuck)
    finally:
        for relay in relays:
            if relay.poll() is None:
                relay.kill()
                relay.wait(10)
        await filler.close()
        await run.clean_up(node)


async def test_a_confirm_timeout_under_a_memory_alarm_goes_to_the_outbox_and_is_relayed_after(
    node: RabbitNode,
    drill_redis_url: str,
    new_drill_run: Callable[[str, Settings], DrillRun],
    tmp_path: Path,
) -> None:
    path = tmp_path / "outbox.db"
    settings = drill_settings(
        node.url,
        drill_redis_url,
        outbox_path=str(path),
        confirm_timeout_s=ALARM_CONFIRM_TIMEOUT_S,
        outbox_relay_interval_s=0.5,
    )
    run = new_drill_run("outbox-alarm", settings)
    ids = run.task_ids(ALARM_PUBLISHES)
    try:
        await run.app.declare()
        await node.set_memory_alarm(True)
        started = time.perf_counter()
        first = await run.app.publish(run.queue, Job(n=0), task_id=ids[0])
        rest = await run.app.publish_many(
            run.queue, [Job(n=i) for i in range(1, ALARM_PUBLISHES)], task_ids=ids[1:]
        )
        publish_s = time.perf_counter() - started
        statuses = {(await run.app.status(t)).status for t in ids}  # type: ignore[union-attr]

        assert [first, *rest] == ids
        assert statuses == {TaskStatus.STORED_LOCALLY}
        assert outbox_count(path) == ALARM_PUBLISHES
        assert publish_s < 2 * ALARM_CONFIRM_TIMEOUT_S + 5

        await node.set_memory_alarm(False)
        await run.start_worker(concurrency=8, settings=worker_settings(settings))
        await wait_until(lambda: outbox_count(path) == 0, 60, "the app's relay to drain")
        exit_code, stuck = await run.finish(node, ids)
        row = run.report(
            "outbox: confirm timeouts under a memory alarm",
            published=ALARM_PUBLISHES,
            confirmed=set(ids),
            notes=f"all stored_locally after {publish_s:.1f} s (confirm timeout "
            f"{ALARM_CONFIRM_TIMEOUT_S} s); relayed after the alarm cleared",
        )
        run.assert_clean(row, exit_code, stuck)
    finally:
        await run.clean_up(node)


async def test_publishes_while_the_broker_is_down_share_a_few_connects_and_one_log_line(
    node: RabbitNode,
    drill_redis_url: str,
    new_drill_run: Callable[[str, Settings], DrillRun],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "outbox.db"
    async with TcpProxy("127.0.0.1", node.port) as proxy:
        settings = drill_settings(
            proxy.url_for(node.url),
            drill_redis_url,
            outbox_path=str(path),
            outbox_relay_interval_s=0.2,
            reconnect_max_delay_s=2,
        )
        run = new_drill_run("outbox-down", settings)
        ids = run.task_ids(DOWN_PUBLISHES + 1)
        try:
            await run.app.declare()
            await run.app.start_outbox()
            proxy.refuse()
            proxy.cut()
            before = proxy.accepted
            caplog.set_level(logging.INFO, logger="weclaw_mq")
            returned = [
                await run.app.publish(run.queue, Job(n=i), task_id=t)
                for i, t in enumerate(ids[:DOWN_PUBLISHES])
            ]
            connects = proxy.accepted - before
            stored = outbox_count(path)
            said = [r for r in caplog.records if r.levelno >= logging.WARNING]

            assert returned == ids[:DOWN_PUBLISHES]
            assert stored == DOWN_PUBLISHES
            assert 1 <= connects <= DOWN_CONNECTS_BOUND, f"{connects} connects"
            texts = [r.getMessage() for r in said]
            assert len([t for t in texts if t.startswith("stored ")]) == 1, texts
            assert len([t for t in texts if "publishes fail at once" in t]) == 1, texts
            assert len([t for t in texts if "outbox relay" in t]) <= 1, texts
            assert len(texts) <= 4, texts

            proxy.pass_traffic()
            await wait_until(lambda: outbox_count(path) == 0, 60, "the relay to drain")
            # The next publish is confirmed: the outage ends, said once, with its count.
            await run.app.publish(run.queue, Job(n=DOWN_PUBLISHES), task_id=ids[-1])
            ended = [r.getMessage() for r in caplog.records if "answers again:" in r.getMessage()]
            assert len(ended) == 1 and f"{DOWN_PUBLISHES} task(s)" in ended[0], ended

            worker = settings.model_copy(update={"outbox_path": None, "amqp_url": node.url})
            await run.start_worker(concurrency=8, settings=worker)
            exit_code, stuck = await run.finish(node, ids)
            row = run.report(
                "outbox: 1000 publishes while the broker is down (connects counted)",
                published=len(ids),
                confirmed=set(ids),
                notes=f"{connects} connect attempts (producer and relay) for "
                f"{DOWN_PUBLISHES} publishes (asserted <= {DOWN_CONNECTS_BOUND}); "
                f"{len(texts)} warning line(s); relayed once the broker was back",
            )
            run.assert_clean(row, exit_code, stuck)
        finally:
            await run.clean_up(node)

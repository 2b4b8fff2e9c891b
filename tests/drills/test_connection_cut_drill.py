"""Drills: connections cut under load, and a connection blackholed.

1. During a 10 000-task publish (50 in flight) every connection to the private node is closed
   by the broker twice (``rabbitmqctl close_all_connections``). Every publish either returned
   (and its task then runs) or raised a ``WeclawMQError``; none hangs. Republishing the failed
   ones with the same task id succeeds, and the worker (a real process) consuming meanwhile
   resumes by itself.
2. The same pipeline through our TCP proxy, which then blackholes the traffic (sockets open,
   no bytes). With ``heartbeat_s = 2`` the worker declares the connection dead within the
   documented bound, (2 + 1) * 3 s, plus one heartbeat tick; publishes meanwhile raise within
   their timeouts; once the proxy passes traffic again the worker reconnects by itself and
   every confirmed task runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import delete_queues, wait_until
from tests.drills import bounds, drill_app
from tests.drills.bounds import CUT_ERROR_TYPES
from tests.drills.conftest import DrillRun, RabbitNode, drill_settings
from tests.drills.drill_app import CONSUMING, LOST, Outcomes
from tests.drills.tcp_proxy import TcpProxy
from tests.integration.processes import queue_names
from weclaw_mq import Settings, WeclawMQError
from weclaw_mq.wire.connection import CONNECT_TIMEOUT_S


def _confirmed_at_least(outcomes: Outcomes, count: int) -> bool:
    return len(outcomes.confirmed) >= count


# -- 1. close_all_connections during a 10 000-task publish ------------------------------------

TASKS = 10_000
IN_FLIGHT = 50
CUTS = 2
# The first cut fires after this many confirms, each later one once the producer has had this
# many confirmed again since the previous cut (cuts are armed beforehand: see arm_cut).
CUT_EVERY = 2_000
CONFIRM_TIMEOUT_S = 5.0
# The broker is up during a cut, so a publish waits at most for its confirm and a reconnect.
CUT_PUBLISH_LIMIT_S = CONFIRM_TIMEOUT_S + CONNECT_TIMEOUT_S + 5


@pytest.mark.drill
async def test_every_publish_during_connection_cuts_is_stored_or_raises(
    node: RabbitNode,
    drill_redis_url: str,
    tmp_path: Path,
    new_drill_run: Callable[[str, Settings], DrillRun],
) -> None:
    settings = drill_settings(node.url, drill_redis_url, confirm_timeout_s=CONFIRM_TIMEOUT_S)
    run = new_drill_run("cut", settings)
    app, queue = run.app, run.queue
    ids = run.task_ids(TASKS)
    outcomes = Outcomes()
    cut_at: list[int] = []
    triggers = [tmp_path / f"cut-{i}" for i in range(CUTS)]
    armed: list[asyncio.Task[str]] = []
    try:
        await app.declare()
        worker = await run.start_worker(concurrency=50)
        todo = iter(enumerate(ids))
        publishing = True

        async def lane() -> None:
            for n, task_id in todo:
                await outcomes.publish(app, queue, n, task_id, CUT_PUBLISH_LIMIT_S)

        armed = [await node.arm_cut(trigger) for trigger in triggers]

        async def cutter() -> None:
            mark = CUT_EVERY
            for trigger, cut in zip(triggers, armed, strict=True):
                await wait_until(partial(_confirmed_at_least, outcomes, mark), 120, f"{mark} sent")
                trigger.touch()
                assert (await cut).strip() == "cut", "the armed close_all_connections did not fire"
                assert publishing, "the publish ended before the cut: nothing was tested"
                cut_at.append(len(outcomes.confirmed) + len(outcomes.failed))
                mark = len(outcomes.confirmed) + CUT_EVERY

        publish_began = time.perf_counter()
        cuts = asyncio.create_task(cutter())
        await asyncio.gather(*(lane() for _ in range(IN_FLIGHT)))
        publishing = False
        await cuts
        publish_s = time.perf_counter() - publish_began

        assert not outcomes.hung, f"{len(outcomes.hung)} publish(es) neither returned nor raised"
        assert not outcomes.foreign, f"raised outside WeclawMQError: {outcomes.foreign}"
        # docs/design/guarantees.md names the errors a publish during a cut raises: no others.
        unnamed = {
            t: type(e).__name__
            for t, e in outcomes.failed.items()
            if type(e).__name__ not in CUT_ERROR_TYPES
        }
        assert not unnamed, f"raised outside {CUT_ERROR_TYPES}: {outcomes.error_kinds()}"
        # The caller's answer to a failed publish: the same task again, same task id.
        retried = Outcomes()
        position = {t: n for n, t in enumerate(ids)}
        for task_id in outcomes.failed:
            await retried.publish(app, queue, position[task_id], task_id, CUT_PUBLISH_LIMIT_S)
        assert not retried.failed and not retried.hung, f"retries failed: {retried.failed}"

        await run.wait_ran(TASKS, 120)
        await run.wait_drained(node.url)
        await run.check_end_state(node)
        assert worker.popen.poll() is None, f"the worker died: {worker.describe()}"
        consumed = worker.log().count(CONSUMING)
        exit_code, stuck = await run.stop_worker()
        await run.check_left_after_stop(node)

        row = run.report(
            f"close_all_connections x{CUTS} during publish",
            published=TASKS,
            confirmed=outcomes.confirmed | retried.confirmed,
            notes=f"cuts after {cut_at} publishes; {len(outcomes.failed)} raised "
            f"({outcomes.error_kinds()}), all republished OK; worker consumed "
            f"{consumed} times; slowest publish {outcomes.slowest_s:.2f} s; "
            f"publishing took {publish_s:.1f} s",
        )
        ran = run.ran()
        assert len(cut_at) == CUTS
        # Every publish that returned is stored: its task ran.
        assert outcomes.confirmed <= set(ran), "a confirmed task never ran"
        assert set(ran) <= set(ids), "the worker ran tasks nobody published"
        assert row.confirmed == TASKS
        run.assert_clean(row, exit_code, stuck)
        # One consume per connection: the first, then one after each cut, no manual action.
        assert consumed >= 1 + CUTS, worker.describe()
    finally:
        for trigger, cut in zip(triggers, armed, strict=False):
            await node.disarm_cut(trigger, cut)
        await run.clean_up(node)


# -- 2. a blackholed connection ---------------------------------------------------------------

HEARTBEAT_S = bounds.HEARTBEAT_S
STUCK_AFTER_S = bounds.HEARTBEAT_STUCK_AFTER_S
DETECT_BOUND_S = bounds.HEARTBEAT_DETECT_BOUND_S
BLACKHOLE_CONFIRM_TIMEOUT_S = 3.0
# During a blackhole a publish waits for its confirm, or for one connect attempt to time out.
BLACKHOLE_PUBLISH_LIMIT_S = BLACKHOLE_CONFIRM_TIMEOUT_S + CONNECT_TIMEOUT_S + 2
# How long the drill lets a publish into the blackhole run before calling it hung.
HUNG_AFTER_S = BLACKHOLE_PUBLISH_LIMIT_S + 5
BEFORE = 1000
AFTER = 500
PROBES = 5  # concurrent publishes into the blackhole, once on the silent link, once after it


def _blackhole_settings(url: str, redis_url: str) -> Settings:
    return drill_settings(
        url, redis_url, heartbeat_s=HEARTBEAT_S, confirm_timeout_s=BLACKHOLE_CONFIRM_TIMEOUT_S
    )


@pytest.mark.drill
async def test_blackholed_connection_is_detected_within_the_heartbeat_bound_and_heals(
    node: RabbitNode, drill_redis_url: str, new_drill_run: Callable[[str, Settings], DrillRun]
) -> None:
    """The link goes silent mid-stream. Publishes on the silent link must raise within the
    confirm timeout; the worker must notice within the heartbeat bound; publishes once the
    link is declared dead must raise within one connect attempt; after the heal the worker
    reconnects by itself and every confirmed task runs.

    The heal is timed just after one of the worker's connect attempts failed, so that the
    next attempt is young when traffic flows again: an attempt that completes its handshake
    later than (heartbeat + 1) * 3 s hits the separate failure that
    ``test_worker_survives_a_link_that_heals_late_in_its_handshake`` pins down.
    """
    proxy = TcpProxy("127.0.0.1", node.port)
    await proxy.start()
    run = new_drill_run("blackhole", _blackhole_settings(proxy.url_for(node.url), drill_redis_url))
    app, queue = run.app, run.queue
    before, after = run.task_ids(BEFORE), run.task_ids(AFTER)
    silent_ids, dead_ids = run.task_ids(PROBES, "probe-"), run.task_ids(PROBES, "probe-")
    on_silent_link, on_dead_link = Outcomes(), Outcomes()
    try:
        await app.declare()
        worker = await run.start_worker(concurrency=5, sleep_s=0.02)
        await drill_app.publish_jobs(app, queue, before)
        await run.wait_ran(200, 30)

        proxy.blackhole()
        holed_at = time.monotonic()
        silent = asyncio.gather(
            *(on_silent_link.publish(app, queue, 0, t, HUNG_AFTER_S) for t in silent_ids)
        )
        await worker.wait_for_log(LOST, DETECT_BOUND_S + 10, "the worker to notice the dead link")
        detect_s = time.monotonic() - holed_at
        await silent
        # The producer's link is dead by now too (same heartbeat): these must reconnect.
        await wait_until(lambda: time.monotonic() - holed_at > DETECT_BOUND_S, DETECT_BOUND_S)
        await asyncio.gather(
            *(on_dead_link.publish(app, queue, 0, t, HUNG_AFTER_S) for t in dead_ids)
        )

        failed_connects = worker.log().count("cannot connect")
        await wait_until(
            lambda: (
                worker.log().count("cannot connect") > failed_connects
                or worker.popen.poll() is not None
            ),
            CONNECT_TIMEOUT_S + 5,
            "a connect attempt of the worker to fail",
        )
        consumed_before_heal = worker.log().count(CONSUMING)
        proxy.pass_traffic()
        healed_at = time.monotonic()
        await wait_until(
            lambda: (
                worker.log().count(CONSUMING) > consumed_before_heal
                or worker.popen.poll() is not None
            ),
            CONNECT_TIMEOUT_S + 10,
            "the worker to reconnect by itself",
        )
        assert worker.popen.poll() is None, f"the worker died: {worker.describe()}"
        reconnect_s = time.monotonic() - healed_at
        await drill_app.publish_jobs(app, queue, after)  # raises unless all are confirmed
        confirmed = set(before) | set(after) | on_silent_link.confirmed | on_dead_link.confirmed
        exit_code, stuck = await run.finish(node, confirmed)

        row = run.report(
            "blackhole (TCP proxy), heartbeat 2 s",
            published=BEFORE + AFTER + 2 * PROBES,
            confirmed=confirmed,
            notes=f"worker noticed in {detect_s:.1f} s ({bounds.heartbeat_bound_text()}), "
            f"reconnected {reconnect_s:.1f} s after the heal; publishes on the silent link: "
            f"{on_silent_link.summary()}; after it died: {on_dead_link.summary()}",
        )
        assert detect_s <= DETECT_BOUND_S, f"noticed after {detect_s:.1f} s"
        for when, probes, limit_s in (
            ("on the silent link", on_silent_link, BLACKHOLE_CONFIRM_TIMEOUT_S + 2),
            ("after the link died", on_dead_link, BLACKHOLE_PUBLISH_LIMIT_S),
        ):
            assert not probes.foreign, f"{when}: raised outside WeclawMQError: {probes.foreign}"
            assert not probes.hung and probes.slowest_s <= limit_s, (
                f"publishes into the blackhole {when} must raise within {limit_s} s: "
                f"{probes.summary()}"
            )
        run.assert_clean(row, exit_code, stuck)
    finally:
        await run.clean_up(node)
        await proxy.close()


# -- 3. a link that heals late in the handshake -----------------------------------------------

# Inside (STUCK_AFTER_S, CONNECT_TIMEOUT_S): the handshake completes before the connect
# timeout, but later than aiormq's stuck-connection bound.
LATE_HEAL_S = (STUCK_AFTER_S + CONNECT_TIMEOUT_S) / 2


@pytest.mark.drill
async def test_worker_survives_a_link_that_heals_late_in_its_handshake(
    node: RabbitNode, drill_redis_url: str, new_drill_run: Callable[[str, Settings], DrillRun]
) -> None:
    """A worker whose connect attempt sat in a blackhole for 9.5 s (heartbeat 2 s) and then
    completed must consume, or fail that attempt and retry; it must not die."""
    proxy = TcpProxy("127.0.0.1", node.port)
    await proxy.start()
    # The run's app only declares, straight to the node; the worker dials through the proxy.
    run = new_drill_run("lateheal", _blackhole_settings(node.url, drill_redis_url))
    try:
        await run.app.declare()
        proxy.blackhole()
        worker = await run.start_worker(
            settings=_blackhole_settings(proxy.url_for(node.url), drill_redis_url),
            consuming_within_s=None,
        )
        await wait_until(lambda: proxy.accepted >= 1, 20, "the worker to dial the broker")
        # Fault timing, not synchronisation: the heal lands at a chosen age of the attempt.
        heal_at = proxy.accepted_at[0] + LATE_HEAL_S
        await asyncio.sleep(heal_at - asyncio.get_running_loop().time())
        proxy.pass_traffic()
        await worker.wait_for_log(CONSUMING, CONNECT_TIMEOUT_S + 10, "the worker to consume")
        assert worker.popen.poll() is None, (
            f"the worker died after a late handshake: {worker.describe()}"
        )
    finally:
        await run.clean_up(node)
        await proxy.close()


@pytest.mark.drill
async def test_publish_over_a_link_that_heals_late_in_its_handshake_raises_a_weclaw_error(
    node: RabbitNode, drill_redis_url: str
) -> None:
    """The producer's side of the same fault: the publish must end in a confirm or in a
    ``WeclawMQError``, never in a ``CancelledError`` its caller would take for its own."""
    queue = f"drill-lateheal-{uuid.uuid4().hex[:8]}"
    proxy = TcpProxy("127.0.0.1", node.port)
    await proxy.start()
    declarer = drill_app.build_app(
        queue, settings=_blackhole_settings(node.url, drill_redis_url), effects=Path("/dev/null")
    )
    app = drill_app.build_app(
        queue,
        settings=_blackhole_settings(proxy.url_for(node.url), drill_redis_url),
        effects=Path("/dev/null"),
    )
    try:
        await declarer.declare()
        proxy.blackhole()

        async def heal_late() -> None:
            await wait_until(lambda: proxy.accepted >= 1, 20, "the producer to dial the broker")
            loop = asyncio.get_running_loop()
            await asyncio.sleep(proxy.accepted_at[0] + LATE_HEAL_S - loop.time())
            proxy.pass_traffic()

        healer = asyncio.create_task(heal_late())
        outcome: BaseException | None = None
        try:
            await asyncio.wait_for(app.publish(queue, drill_app.Job(n=1)), HUNG_AFTER_S)
        except BaseException as e:  # the point: which kind of exception comes out
            outcome = e
        await healer
        assert outcome is None or isinstance(outcome, WeclawMQError), (
            f"publish raised {type(outcome).__name__}, not a WeclawMQError"
        )
        # And the next publish, over a link that now works, is confirmed.
        await app.publish(queue, drill_app.Job(n=2))
    finally:
        await app.close()
        await declarer.close()
        await proxy.close()
        await delete_queues(node.url, queue_names(declarer))

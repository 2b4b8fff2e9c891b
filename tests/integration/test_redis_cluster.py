"""The Redis store on a Redis Cluster of the session's own (three primaries), beyond the core
cases ``test_task_stores.py`` runs on it: what differs on a cluster is that a task's keys
live on one node of several, so a pipeline spans nodes and a waiter may subscribe on a node
other than the one whose script publishes. Also the worker registry (``weclaw-mq inspect``)
of a worker whose store is the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.conftest import delete_queues, settings_for, wait_until
from tests.integration.processes import FIXTURE_APP, queue_names, run_cli, settings_env
from tests.private_servers import PrivateRedisCluster
from weclaw_mq import App, Worker
from weclaw_mq.admin.dependency_checks import check_redis
from weclaw_mq.contract.naming import (
    WORKER_INDEX_KEY,
    done_channel,
    guard_key,
    worker_key,
    workflow_key,
    workflow_parts_key,
)
from weclaw_mq.state import CancelOutcome, Claim, TaskState, TaskStatus, open_store
from weclaw_mq.state.redis import RedisTaskStore
from weclaw_mq.state.redis_clients import open_client
from weclaw_mq.state.worker_registry import WorkerRegistry
from weclaw_mq.streaming.events import attempt_entry, chunk_entry, encode_data, final_entry
from weclaw_mq.streaming.redis import open_redis_streams

QUEUE = "cluster-q"
LEASE_S = 0.6


def _store(url: str, **overrides: float) -> RedisTaskStore:
    settings = settings_for("amqp://unused", url, result_ttl_s=120, done_ttl_s=120, **overrides)
    store = open_store(settings)
    assert isinstance(store, RedisTaskStore)
    return store


@pytest.fixture
async def store(redis_cluster: PrivateRedisCluster) -> AsyncIterator[RedisTaskStore]:
    store = _store(redis_cluster.url, guard_lease_s=LEASE_S)
    try:
        yield store
    finally:
        await store.close()


def _ids_on_every_node(cluster: PrivateRedisCluster, per_node: int) -> list[str]:
    """Task ids whose keys fall on each primary ``per_node`` times (slots as redis-cli made
    them: three even ranges, read back from the cluster itself)."""
    client = cluster.nodes[0].client()
    try:
        ranges = [(int(r[0]), int(r[1])) for r in client.execute_command("CLUSTER", "SLOTS")]
        chosen: dict[int, list[str]] = {n: [] for n in range(len(ranges))}
        while any(len(v) < per_node for v in chosen.values()):
            task_id = str(uuid.uuid4())
            slot = int(client.cluster("keyslot", guard_key(QUEUE, task_id)))
            node = next(n for n, (lo, hi) in enumerate(ranges) if lo <= slot <= hi)
            if len(chosen[node]) < per_node:
                chosen[node].append(task_id)
    finally:
        client.close()
    return [t for ids in chosen.values() for t in ids]


async def test_a_result_wakes_its_waiter_and_subscribers_on_every_node(
    redis_cluster: PrivateRedisCluster, store: RedisTaskStore
) -> None:
    task_id = str(uuid.uuid4())
    # Classic pub/sub on a cluster: a PUBLISH on the node that runs the finish script reaches
    # subscribers on every node (the store's waiter subscribes on the slot's own node).
    listeners = [
        aioredis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5)
        for node in redis_cluster.nodes
    ]
    subs = [client.pubsub() for client in listeners]
    try:
        for sub in subs:
            await sub.subscribe(done_channel(task_id))
            assert (await sub.get_message(timeout=5))["type"] == "subscribe"
        waiter = asyncio.create_task(store.wait(task_id, 10))
        # The waiter subscribed and read "no record yet" once: it now waits for a message.
        await asyncio.sleep(0.3)
        assert not waiter.done()
        finished = time.perf_counter()
        await store.finish(
            QUEUE, task_id, TaskState(task_id=task_id, queue=QUEUE, status=TaskStatus.SUCCEEDED)
        )
        state = await asyncio.wait_for(waiter, 10)
        woken_s = time.perf_counter() - finished
        assert state.status is TaskStatus.SUCCEEDED
        # Well under the 2 s re-read a waiter does without a message: the message woke it.
        assert woken_s < 1.0, f"waiter woke {woken_s:.2f} s after the finish"
        for node, sub in zip(redis_cluster.nodes, subs, strict=True):
            message = await sub.get_message(ignore_subscribe_messages=True, timeout=5)
            assert message is not None, f"no wake-up reached the subscriber on {node.address}"
            assert message["data"] == QUEUE.encode()
    finally:
        for sub, client in zip(subs, listeners, strict=True):
            await sub.aclose()  # type: ignore[no-untyped-call]
            await client.aclose()


async def test_leases_held_on_every_node_are_renewed_by_the_pipelined_renewal(
    redis_cluster: PrivateRedisCluster, store: RedisTaskStore
) -> None:
    # The renewal is one pipeline of a script call per held lease, across the nodes; redis-py
    # refuses EVALSHA in a cluster pipeline, so without the client's EVAL of the script's
    # text every renewal failed and the leases lapsed.
    ids = _ids_on_every_node(redis_cluster, per_node=4)
    for task_id in ids:
        assert await store.claim(QUEUE, task_id, "first") is Claim.ACQUIRED
    with contextlib.ExitStack() as stack:
        for task_id in ids:
            stack.enter_context(store.holding(QUEUE, task_id, "first"))
        # Three lease periods: a lease that was not renewed has lapsed by then.
        await asyncio.sleep(3 * LEASE_S)
        answers = [await store.claim(QUEUE, task_id, "second") for task_id in ids]
    assert answers == [Claim.BUSY] * len(ids)


async def test_claims_of_a_worker_that_is_gone_are_taken_over_on_every_node(
    redis_cluster: PrivateRedisCluster, store: RedisTaskStore
) -> None:
    # The heartbeat key lives on one node, the claims on all three: the takeover asks for the
    # heartbeat in a command of its own (a script may not reach across slots on a cluster).
    gone = _store(redis_cluster.url, guard_lease_s=30, guard_heartbeat_ttl_s=0.5)
    ids = _ids_on_every_node(redis_cluster, per_node=2)
    for task_id in ids:
        assert await gone.claim(QUEUE, task_id, "gone") is Claim.ACQUIRED
    assert [await store.claim(QUEUE, t, "next") for t in ids] == [Claim.BUSY] * len(ids)
    await gone.close()  # its renewer stops, its claims stay: as if it died

    taken: set[str] = set()

    async def all_taken_over() -> bool:
        for task_id in set(ids) - taken:
            if await store.claim(QUEUE, task_id, "next") is Claim.ACQUIRED:
                taken.add(task_id)
        return len(taken) == len(ids)

    await wait_until(all_taken_over, 5, "the gone worker's claims to be free")
    assert [await store.claim(QUEUE, t, "third") for t in ids] == [Claim.BUSY] * len(ids)


async def test_scripts_queued_on_a_cluster_pipeline_run_on_their_nodes_awaited_or_not(
    redis_cluster: PrivateRedisCluster,
) -> None:
    # AsyncScript awaits what a pipeline's evalsha returns (which re-initialised, i.e.
    # emptied, redis-py's cluster pipeline); an auto-pipeliner queues it without awaiting.
    client = open_client(settings_for("amqp://unused", redis_cluster.url))
    script = client.register_script("return redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000)")
    keys = [f"weclaw-test:pipeline:{{{t}}}" for t in _ids_on_every_node(redis_cluster, 2)]
    try:
        async with client.pipeline(transaction=False) as pipe:
            for n, key in enumerate(keys):
                if n % 2:
                    await script(keys=[key], args=[str(n)], client=pipe)  # type: ignore[arg-type]
                else:
                    pipe.evalsha(script.sha, 1, key, str(n))
            answers = await pipe.execute()
        assert answers == [b"OK"] * len(keys)
        assert [await client.get(k) for k in keys] == [str(n).encode() for n in range(len(keys))]
    finally:
        await client.delete(*keys)
        await client.aclose()


async def test_records_of_new_tasks_on_every_node_are_written_and_never_overwrite(
    redis_cluster: PrivateRedisCluster, store: RedisTaskStore
) -> None:
    # publish_many's path: one call for the batch, whose tasks hash to different nodes.
    ids = _ids_on_every_node(redis_cluster, per_node=3)
    running = TaskState(task_id=ids[0], queue=QUEUE, status=TaskStatus.RUNNING)
    assert await store.record(running)
    queued = [TaskState(task_id=t, queue=QUEUE, status=TaskStatus.QUEUED) for t in ids]
    await store.record_many(queued, only_if_new=True)
    found = [await store.get(t) for t in ids]
    statuses = [s.status if s is not None else None for s in found]
    assert statuses == [TaskStatus.RUNNING] + [TaskStatus.QUEUED] * (len(ids) - 1)


async def test_the_health_check_reaches_the_cluster_and_never_shows_a_password(
    redis_cluster: PrivateRedisCluster,
) -> None:
    ok = await check_redis(settings_for("amqp://unused", redis_cluster.url))
    assert ok.ok, ok.detail
    assert ok.detail == redis_cluster.url
    secret = "s3cret-pw"
    # Port 1: nothing listens there.
    down = await check_redis(
        settings_for("amqp://unused", f"redis+cluster://:{secret}@127.0.0.1:1")
    )
    assert not down.ok
    assert secret not in down.detail, down.detail
    assert "redis+cluster://:***@127.0.0.1:1" in down.detail, down.detail


async def test_the_stream_store_writes_a_task_stream_and_a_session_inbox_on_two_nodes(
    redis_cluster: PrivateRedisCluster,
) -> None:
    # One write puts a task's events in its stream and in its session's inbox, one pipeline
    # over the two keys' nodes (their hash tags differ: {task id}, {session id}).
    on_node = _ids_on_every_node(redis_cluster, per_node=1)
    task_id, session_id = on_node[0], on_node[-1]
    streams = open_redis_streams(settings_for("amqp://unused", redis_cluster.url))
    try:
        entries = [attempt_entry(task_id, 1), chunk_entry(task_id, 1, encode_data("hi"))]
        await streams.write(task_id, entries, session_id=session_id)
        final = TaskState(task_id=task_id, queue=QUEUE, status=TaskStatus.SUCCEEDED, result=1)
        await streams.end(task_id, final_entry(final))
        kinds = [e.kind for e in await streams.read(task_id, "0-0", 0)]
        assert kinds == ["attempt", "chunk", "final"]
        inbox = await streams.read_inbox(session_id, "0-0", 0)
        assert [(e.kind, e.task_id) for e in inbox] == [("attempt", task_id), ("chunk", task_id)]
    finally:
        await streams.close()


@pytest.mark.parametrize("prefix", ["}", "{", ""], ids=["close_brace", "open_brace", "plain"])
async def test_a_task_whose_id_starts_with_a_brace_is_claimed_finished_and_cancelled(
    store: RedisTaskStore, prefix: str
) -> None:
    # "{}..." is an empty hash tag, which Redis hashes whole: before naming gave such ids one
    # more '{', every script over two keys of "}x" failed with CROSSSLOT.
    done, doomed = f"{prefix}done-{uuid.uuid4()}", f"{prefix}doomed-{uuid.uuid4()}"
    running = TaskState(task_id=done, queue=QUEUE, status=TaskStatus.RUNNING)
    assert await store.claim(QUEUE, done, "me", running=running) is Claim.ACQUIRED
    await store.finish(
        QUEUE, done, TaskState(task_id=done, queue=QUEUE, status=TaskStatus.SUCCEEDED, result=1)
    )
    latest = await store.get(done)
    assert latest is not None and latest.result == 1
    assert await store.claim(QUEUE, done, "again") is Claim.DONE

    assert await store.record(TaskState(task_id=doomed, queue=QUEUE, status=TaskStatus.QUEUED))
    for queue in (None, QUEUE):  # the pointer's read, then the named record's
        assert (await store.cancel(doomed, queue=queue)).outcome is not CancelOutcome.PENDING
    assert await store.is_cancelled(QUEUE, doomed)
    assert await store.claim(QUEUE, doomed, "me") is Claim.CANCELLED
    assert await store.keep_fingerprint(QUEUE, doomed, "first", 60) == "first"
    assert await store.keep_fingerprint(QUEUE, doomed, "second", 60) == "first"


async def test_a_thousand_waiters_on_every_node_fit_a_pool_of_four_per_node(
    redis_cluster: PrivateRedisCluster,
) -> None:
    # Each waiter used to hold a pub/sub connection of its node's pool; now they share one.
    small = _store(redis_cluster.url, redis_max_connections=4)
    ids = _ids_on_every_node(redis_cluster, 334)
    waiters = [asyncio.ensure_future(small.wait(t, 60, queue=QUEUE)) for t in ids]
    try:
        # Confirmed by Redis: the last waiter's channel is subscribed on some node (classic
        # pub/sub counts subscribers per node), or some waiter failed.
        probes = [aioredis.Redis(host="127.0.0.1", port=node.port) for node in redis_cluster.nodes]
        try:

            async def subscribed() -> bool:
                if any(w.done() for w in waiters):
                    return True
                counts = [
                    await p.execute_command("PUBSUB", "NUMSUB", done_channel(ids[-1]))
                    for p in probes
                ]
                return sum(int(c[1]) for c in counts) >= 1

            await wait_until(subscribed, 30, "the last waiter's subscription")
        finally:
            for p in probes:
                await p.aclose()
        failed = [w for w in waiters if w.done()]
        assert not failed, f"{len(failed)} waiters ended early: {failed[0].exception()!r}"
        for task_id in ids:
            await small.record(TaskState(task_id=task_id, queue=QUEUE, status=TaskStatus.SUCCEEDED))
        states = await asyncio.wait_for(asyncio.gather(*waiters), 60)
        assert [s.task_id for s in states] == ids
        assert {s.status for s in states} == {TaskStatus.SUCCEEDED}
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await small.close()


async def test_inspect_lists_a_worker_running_on_a_cluster_and_forgets_it_at_its_stop(
    redis_cluster: PrivateRedisCluster,
    qname: str,
    tmp_path: Path,
    broker_url: str,
) -> None:
    # The registry's keys share the tag {workers}: one slot, so the beat's script (through
    # the store's cluster pipeline) and the read's MGET each run whole on one node.
    probe = redis_cluster.nodes[0].client()
    try:
        slots = {int(probe.cluster("keyslot", k)) for k in (WORKER_INDEX_KEY, worker_key("w"))}
    finally:
        probe.close()
    assert len(slots) == 1
    app = App(
        "cluster-inspect", settings=settings_for(broker_url, redis_cluster.url, worker_beat_s=0.1)
    )
    started, release = asyncio.Event(), asyncio.Event()

    @app.handler(qname)
    async def hold(task: dict[str, int]) -> None:
        started.set()
        await release.wait()

    worker = Worker(app, concurrency=2)
    running = asyncio.create_task(worker.run())
    client = open_client(settings_for(broker_url, redis_cluster.url))
    registry = WorkerRegistry(client)
    try:
        await asyncio.wait_for(worker.ready.wait(), 20)
        task_id = await app.publish(qname, {"n": 1})
        await wait_until(started.is_set, what="the handler to start")

        async def listed() -> list[str]:
            records = [r for r in await registry.read() if r.worker_id == worker.worker_id]
            return [t.task_id for r in records for t in r.tasks if t.running_s is not None]

        await wait_until(listed, what="a beat on the cluster")
        env = {
            **settings_env(settings_for(broker_url, redis_cluster.url)),
            "TEST_QUEUE": qname,
            "TEST_RECORD_DIR": str(tmp_path),
        }
        shown = await run_cli("inspect", FIXTURE_APP, "--json", env=env)
        assert shown.code == 0, shown.stderr
        (me,) = json.loads(shown.stdout)["workers"]
        assert me["worker_id"] == worker.worker_id
        assert [t["task_id"] for t in me["tasks"]] == [task_id]
        release.set()
    finally:
        release.set()
        worker.stop()
        await asyncio.wait_for(running, 30)
    try:
        assert [r for r in await registry.read() if r.worker_id == worker.worker_id] == []
    finally:
        await client.aclose()
        await app.close()
        await delete_queues(broker_url, queue_names(app))


async def test_workflow_steps_run_on_the_nodes_of_their_groups_and_the_sweep_finds_them(
    redis_cluster: PrivateRedisCluster, store: RedisTaskStore
) -> None:
    # Groups whose keys fall on every node: each join is one script on the group's own slot
    # (its two keys share the hash tag), the deadlines' sorted set is one key elsewhere.
    flows = store.workflow_store()
    groups = _ids_on_every_node(redis_cluster, 2)
    client = open_client(settings_for("amqp://unused", redis_cluster.url))
    try:
        for g in groups:
            await flows.create(
                g, "{}", kind="group", size=3, policy="pass", deadline_ms=1, keep_ms=60_000
            )
        outcome = {"status": "succeeded", "result": 1}
        answers = await asyncio.gather(
            *(flows.join(g, i, outcome, ends_group=None) for g in groups for i in (0, 1, 1))
        )
        assert {a.step.value for a in answers} == {"counted"}  # part 1 counted once
        due = await flows.due(2, limit=100, lease_ms=60_000)
        assert set(groups) <= set(due)
        expired = await asyncio.gather(*(flows.expire(g) for g in groups))
        assert all(e.now and e.outcome is not None for e in expired)
        assert {tuple(e.outcome["missing"]) for e in expired if e.outcome} == {(2,)}
        again = await flows.join(groups[0], 2, outcome, ends_group=None)
        assert (again.step.value, again.now) == ("ended", False)
    finally:
        for g in groups:
            await flows.forget_deadline(g)
            await client.delete(workflow_key(g))
            await client.delete(workflow_parts_key(g))
        await client.aclose()

"""The auto-pipeline (weclaw_mq.state.pipelining) against the real Redis.

Every behaviour is checked on both ways a batch goes out: the lean path (packed here, sent on
a connection of the client's pool) and redis-py's own (a pipeline, or the plain command when
alone), which a cluster client keeps. The pipeline is subclassed only to record the size of
each round trip; the client only to record the commands it sends itself. Redis answers every
command for real. The lean path's own cases are in test_lean_redis_path.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from weclaw_mq.contract.naming import guard_key, latest_key, state_key
from weclaw_mq.errors import StateCommandError
from weclaw_mq.state import Claim, RedisTaskStore, TaskState, TaskStatus, new_owner
from weclaw_mq.state.pipelining import AutoPipeline, LeanSender, Script

# Appends ARGV[1] to the list KEYS[1] and answers the list's length: the order of arrival.
APPEND = Script.of("return redis.call('RPUSH', KEYS[1], ARGV[1])")
FAIL = Script.of("return redis.error_reply('this one fails')")


class CountingRedis(aioredis.Redis):
    """redis-py's client, recording the size of each pipeline and each command sent alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipelines: list[int] = []
        self.alone: list[str] = []

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def counted(raise_on_error: bool = True) -> list[Any]:
            self.pipelines.append(len(pipe.command_stack))
            return await execute(raise_on_error=raise_on_error)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.alone.append(str(args[0]))
        return super().execute_command(*args, **options)


class CountingPipe(AutoPipeline):
    """The auto-pipeline, recording how many commands each round trip carried."""

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.batches: list[int] = []

    async def _execute(self, calls: list[Any]) -> list[Any]:
        self.batches.append(len(calls))
        return await super()._execute(calls)


async def forget_task_keys(client: aioredis.Redis, queue: str, task_ids: list[str]) -> None:
    keys = [guard_key(queue, t) for t in task_ids] + [state_key(queue, t) for t in task_ids]
    await client.delete(*keys, *(latest_key(t) for t in task_ids))


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[CountingRedis]:
    # As the store's own client: no retry (redis-py's default for from_url is 3), so the
    # lean path stays on (a client that retries keeps redis-py's path: test_lean_redis_path).
    client = CountingRedis.from_url(redis_url, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    assert isinstance(client, CountingRedis)
    yield client
    await client.aclose()


@pytest.fixture(params=[True, False], ids=["lean", "redis-py"])
def lean(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def make_pipe(client: CountingRedis, lean: bool) -> Iterator[Any]:
    made: list[CountingPipe] = []

    def make(**kwargs: Any) -> CountingPipe:
        made.append(CountingPipe(client, lean=lean, **kwargs))
        return made[-1]

    yield make
    for pipe in made:  # every batch went the way this test is about
        assert (pipe._lean is not None) is lean


@pytest.fixture
async def key(client: CountingRedis) -> AsyncIterator[str]:
    name = f"weclaw-test:pipelining:{uuid.uuid4().hex}"
    yield name
    await client.delete(name)


async def test_commands_of_one_loop_iteration_go_out_as_one_pipeline_in_order(
    client: CountingRedis, key: str, make_pipe: Any, lean: bool
) -> None:
    # The script cached first: on a Redis that never ran it, the batch would go out twice
    # (EVALSHA answered NOSCRIPT, then again after SCRIPT LOAD; tested on its own below).
    await client.script_load(APPEND.text)
    pipe = make_pipe()
    answers = await asyncio.gather(*(pipe.script(APPEND, [key], [str(i)]) for i in range(20)))
    assert answers == list(range(1, 21)), answers  # each its own answer: its position on arrival
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(20)]
    assert pipe.batches == [20]
    assert client.pipelines == ([] if lean else [20])  # the lean path builds no pipeline


async def test_a_script_redis_does_not_know_is_loaded_once_and_its_batch_sent_again(
    client: CountingRedis, key: str, make_pipe: Any
) -> None:
    # A text no Redis has seen (as after a restart or SCRIPT FLUSH): EVALSHA answers NOSCRIPT.
    fresh = Script.of(f"-- {uuid.uuid4().hex}\nreturn redis.call('RPUSH', KEYS[1], ARGV[1])")
    pipe = make_pipe()
    answers = await asyncio.gather(*(pipe.script(fresh, [key], [str(i)]) for i in range(5)))
    assert answers == list(range(1, 6)), answers
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(5)]
    # The first try ran nothing; one SCRIPT LOAD, then the same batch once more.
    assert pipe.batches == [5, 5]
    assert client.alone.count("SCRIPT LOAD") == 1, client.alone


async def test_a_failing_command_fails_only_its_caller(
    client: CountingRedis, key: str, make_pipe: Any
) -> None:
    await client.set(key, "a string, not a hash")
    for script in (APPEND, FAIL):  # cached: no NOSCRIPT round trip in this test
        await client.script_load(script.text)
    other = f"{key}:list"
    pipe = make_pipe()
    try:
        answers = await asyncio.gather(
            pipe.script(APPEND, [other], ["first"]),
            pipe.script(FAIL, [other], []),
            pipe.hget(key, "field"),  # WRONGTYPE
            pipe.script(APPEND, [other], ["last"]),
            return_exceptions=True,
        )
    finally:
        await client.delete(other)
    assert answers[0] == 1 and answers[3] == 2, answers
    assert isinstance(answers[1], ResponseError) and "this one fails" in str(answers[1])
    assert isinstance(answers[2], ResponseError) and "WRONGTYPE" in str(answers[2])
    assert pipe.batches == [4]


async def test_a_burst_is_split_at_the_batch_bound(
    client: CountingRedis, key: str, make_pipe: Any
) -> None:
    pipe = make_pipe(max_batch=4)
    answers = await asyncio.gather(*(pipe.script(APPEND, [key], [str(i)]) for i in range(10)))
    assert answers == list(range(1, 11))  # one after the other: still in the order of issue
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(10)]
    assert pipe.batches == [4, 4, 2]


async def test_commands_issued_during_a_round_trip_leave_together_after_it(
    client: CountingRedis, key: str, make_pipe: Any
) -> None:
    pipe = make_pipe()  # one round trip in flight at a time
    first = pipe.script(APPEND, [key], ["first"])
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert pipe.batches == [1] and not first.done()  # out, not answered yet
    later = [pipe.script(APPEND, [key], [str(i)]) for i in range(5)]
    await asyncio.sleep(0)
    assert pipe.batches == [1]  # they wait for the first round trip
    assert await first == 1
    assert await asyncio.gather(*later) == [2, 3, 4, 5, 6]
    assert pipe.batches == [1, 5]


async def test_a_lone_command_is_sent_on_the_next_loop_iteration(
    client: CountingRedis, key: str, make_pipe: Any, lean: bool
) -> None:
    pipe = make_pipe()
    answer = pipe.script(APPEND, [key], ["alone"])
    assert pipe.batches == []  # queued, not sent yet
    await asyncio.sleep(0)  # one loop iteration: the flush sends it, without a timer
    await asyncio.sleep(0)  # (its send task's first step)
    assert pipe.batches == [1]
    assert client.alone == ([] if lean else ["EVALSHA"])
    assert await answer == 1
    assert client.pipelines == []  # alone: no pipeline built on either path


async def test_a_script_redis_does_not_know_is_loaded_and_run(
    client: CountingRedis, key: str, make_pipe: Any
) -> None:
    # Text of this test run only: no Redis has it cached yet, alone or in a pipeline.
    fresh = Script.of(f"-- {uuid.uuid4().hex}\nreturn redis.call('RPUSH', KEYS[1], ARGV[1])")
    fresher = Script.of(f"-- {uuid.uuid4().hex}\nreturn redis.call('RPUSH', KEYS[1], ARGV[1])")
    pipe = make_pipe()
    assert await pipe.script(fresh, [key], ["a"]) == 1
    answers = await asyncio.gather(*(pipe.script(fresher, [key], [x]) for x in "bc"))
    assert answers == [2, 3]
    assert await client.lrange(key, 0, -1) == [b"a", b"b", b"c"]


async def test_a_caller_cancelled_before_the_flush_sends_nothing(
    client: CountingRedis, key: str, make_pipe: Any
) -> None:
    pipe = make_pipe()
    dropped = pipe.script(APPEND, [key], ["dropped"])
    kept = pipe.script(APPEND, [key], ["kept"])
    dropped.cancel()
    assert await kept == 1
    assert await client.lrange(key, 0, -1) == [b"kept"]


async def test_a_failed_round_trip_fails_every_caller_of_its_batch(lean: bool) -> None:
    # A port nobody listens on: the connection itself fails.
    dead = aioredis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    pipe = AutoPipeline(dead, lean=lean)
    answers = await asyncio.gather(
        *(pipe.script(APPEND, ["k"], [str(i)]) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(a, RedisConnectionError) for a in answers), answers
    await dead.aclose()


async def test_one_tasks_failing_claim_in_a_batch_fails_only_that_task(
    client: CountingRedis, key: str
) -> None:  # (the store's own auto-pipeline: the lean path)
    # Through the store: three claims issued together; the middle task's record key holds
    # a string, so its claim script fails in Redis. The other two are claimed.
    store = RedisTaskStore(client, ttl_s=60, lease_s=5, done_ttl_s=60)
    queue = key.replace(":", "-")
    ids = [f"{uuid.uuid4().hex}-{i}" for i in range(3)]
    await client.set(state_key(queue, ids[1]), "not a hash")

    def running(task_id: str) -> TaskState:
        return TaskState(task_id=task_id, queue=queue, status=TaskStatus.RUNNING)

    try:
        answers = await asyncio.gather(
            *(store.claim(queue, t, new_owner(), running=running(t)) for t in ids),
            return_exceptions=True,
        )
        assert answers[0] is Claim.ACQUIRED and answers[2] is Claim.ACQUIRED, answers
        # Redis refused it (WRONGTYPE): a command error, not an outage (issue 24, item 6).
        assert isinstance(answers[1], StateCommandError), answers
        # The three claims, and in front the store's first heartbeat (which they name) and
        # the task index's trim (a store trims at its first index write).
        assert store._pipe.round_trips == 1 and store._pipe.sent_commands == 3 + 2
    finally:
        await forget_task_keys(client, queue, ids)
        await store.close()


async def test_close_lets_go_of_a_round_trip_that_never_ends(lean: bool) -> None:
    # A server that accepts and never answers: the batch would wait for the socket timeout.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    silent = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
    pipe = AutoPipeline(silent, lean=lean)
    waiting = pipe.script(APPEND, ["k"], ["x"])
    queued_after = None
    try:
        await asyncio.sleep(0.05)  # sent, no answer
        queued_after = pipe.script(APPEND, ["k"], ["y"])  # waits for the round trip
        await asyncio.wait_for(pipe.close(), 2)
        assert waiting.cancelled() and queued_after.cancelled()
    finally:
        server.close()
        await silent.aclose()


class _SwallowsOneCancel:
    """A client whose command swallows the first cancellation and then waits again, as a
    redis-py write inside Python 3.11's asyncio.wait_for can when the cancel arrives just as
    the write completes (the read that follows then waits for its socket timeout)."""

    def __init__(self) -> None:
        self.cancels = 0

    async def hget(self, key: str, field: str) -> None:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancels += 1
                if self.cancels > 1:
                    raise


async def test_close_cancels_again_a_round_trip_that_swallowed_its_cancellation() -> None:
    client = _SwallowsOneCancel()
    pipe = AutoPipeline(client)
    waiting = pipe.hget("k", "f")
    await asyncio.sleep(0)  # the flush: the round trip is out
    await asyncio.sleep(0)
    await asyncio.wait_for(pipe.close(), 2)
    assert client.cancels == 2
    assert waiting.cancelled()


def test_a_pipeline_left_behind_by_a_closed_loop_serves_the_next_one(
    redis_url: str, lean: bool
) -> None:
    # A store reused across asyncio.run calls: the first loop ends with a command queued
    # (its flush never ran) and one in flight; the next loop's commands still go out.
    key = f"weclaw-test:pipelining:{uuid.uuid4().hex}"
    state: dict[str, Any] = {}

    async def leave_work_behind() -> None:
        client = aioredis.Redis.from_url(redis_url)
        pipe = AutoPipeline(client, lean=lean)
        state["pipe"] = pipe
        pipe.script(APPEND, [key], ["in flight"])
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # sent, not answered
        pipe.script(APPEND, [key], ["queued"])

    async def use_it_again() -> list[Any]:
        client = aioredis.Redis.from_url(redis_url)
        # The old loop's connections are gone with it: a client (and pool) of this loop.
        state["pipe"]._client = client
        if lean:
            state["pipe"]._lean = LeanSender.for_client(client)
        try:
            answer = await asyncio.wait_for(state["pipe"].script(APPEND, [key], ["next"]), 5)
            return [answer, await client.lrange(key, 0, -1)]
        finally:
            await client.delete(key)
            await client.aclose()

    asyncio.run(leave_work_behind())
    answer, stored = asyncio.run(use_it_again())
    assert b"next" in stored and answer == len(stored)

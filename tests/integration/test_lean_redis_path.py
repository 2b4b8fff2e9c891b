"""The auto-pipeline's lean path (weclaw_mq.state.pipelining.LeanSender) against real Redis.

The lean path packs each command itself and sends a batch on a connection of the client's
own pool; these tests check that it answers exactly what redis-py answers for the same
commands (any arguments, RESP2 and RESP3, decoded or not), that failures stay where redis-py
puts them (a command's error is its caller's; a lost connection fails its batch, and the
next batch gets a fresh connection), and that the clients it must not serve keep redis-py's
own path. The behaviours both paths share are in test_pipelining.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.drills.tcp_proxy import TcpProxy
from tests.private_servers import PrivateRedis
from weclaw_mq.settings import Settings
from weclaw_mq.state.pipelining import AutoPipeline, LeanSender, Script
from weclaw_mq.state.redis_clients import _Cluster, open_client

APPEND = Script.of("return redis.call('RPUSH', KEYS[1], ARGV[1])")
# Every argument back as Redis received it, and the key: what packing produced, byte for byte.
ECHO = Script.of("local out = {KEYS[1]} for i = 1, #ARGV do out[#out + 1] = ARGV[i] end return out")

# Arguments whose bytes matter: RESP's own markers, NUL, non-ASCII text, numbers.
AWKWARD: list[Any] = [
    b"\x00\r\n$3\r\n*1\r\n",
    "é✓ 中文",
    "",
    b"",
    0,
    -17,
    2**70,
    1.5,
    "x" * 20_000,  # past redis-py's own 6,000-byte chunking
    bytearray(b"\xff\xfe"),
]


# The store's own clients retry nothing (redis_clients); redis-py's default for a client it
# makes itself is 3 retries, which keeps redis-py's path (the last test).
NO_RETRY = Retry(NoBackoff(), 0)


class CountingPipe(AutoPipeline):
    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.batches: list[int] = []
        self.sending = asyncio.Event()  # set as a batch starts (it is written before it waits)

    async def _execute(self, calls: list[Any]) -> list[Any]:
        self.batches.append(len(calls))
        self.sending.set()
        return await super()._execute(calls)


@pytest.fixture
def key() -> str:
    return f"weclaw-test:lean:{uuid.uuid4().hex}"


@pytest.fixture
async def client(redis_url: str, key: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=5, retry=NO_RETRY)
    yield client
    await client.delete(key, f"{key}:hash", f"{key}:other")
    await client.aclose()


def test_the_stores_plain_client_takes_the_lean_path_and_a_cluster_client_does_not(
    redis_url: str,
) -> None:
    assert LeanSender.for_client(open_client(Settings(redis_url=redis_url))) is not None
    cluster = _Cluster(startup_nodes=[ClusterNode("127.0.0.1", 1)])  # (connects on first use)
    assert AutoPipeline(cluster)._lean is None
    shared = aioredis.Redis.from_url(redis_url, single_connection_client=True)
    assert LeanSender.for_client(shared) is None  # one connection of its own, with its lock
    called = aioredis.Redis.from_url(redis_url)
    called.set_response_callback("EVALSHA", lambda r, **_: r)
    assert LeanSender.for_client(called) is None  # the caller's callback must run


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
async def test_answers_are_what_redis_py_answers_for_any_argument(
    redis_url: str, key: str, protocol: int, decode: bool
) -> None:
    client = aioredis.Redis.from_url(
        redis_url, protocol=protocol, decode_responses=decode, retry=NO_RETRY
    )
    try:
        await client.script_load(ECHO.text)
        await client.hset(f"{key}:hash", "state", "é✓ 中文")
        pipe = AutoPipeline(client)
        assert pipe._lean is not None
        # Decoded answers must be text: redis-py fails a reply that is not (on both paths).
        args = [a for a in AWKWARD if not decode or a != bytearray(b"\xff\xfe")]
        lean = await asyncio.gather(
            *(pipe.script(ECHO, [key], [arg, "next"]) for arg in args),
            pipe.hget(f"{key}:hash", "state"),
            pipe.hget(f"{key}:hash", "missing"),
        )
        theirs = [await client.evalsha(ECHO.sha, 1, key, arg, "next") for arg in args]
        theirs += [await client.hget(f"{key}:hash", "state")]
        theirs += [await client.hget(f"{key}:hash", "missing")]
        assert lean == theirs
        assert lean[-2] == ("é✓ 中文" if decode else "é✓ 中文".encode())
        assert lean[-1] is None
        assert pipe._lean is not None  # (still: these went the lean way)
    finally:
        await client.delete(f"{key}:hash")
        await client.aclose()


async def test_answers_come_back_in_order_each_to_its_caller(
    client: aioredis.Redis, key: str
) -> None:
    await client.script_load(APPEND.text)
    pipe = CountingPipe(client, max_batch=7)
    answers = await asyncio.gather(*(pipe.script(APPEND, [key], [str(i)]) for i in range(30)))
    assert answers == list(range(1, 31))
    assert await client.lrange(key, 0, -1) == [str(i).encode() for i in range(30)]
    assert pipe.batches == [7, 7, 7, 7, 2]
    assert pipe._lean is not None


async def test_an_argument_redis_py_refuses_fails_its_caller_only(
    client: aioredis.Redis, key: str
) -> None:
    pipe = AutoPipeline(client)
    first = pipe.script(APPEND, [key], ["first"])
    with pytest.raises(DataError):  # redis-py's rule: a bool is not an argument
        pipe.script(APPEND, [key], [True])
    last = pipe.script(APPEND, [key], ["last"])
    assert await asyncio.gather(first, last) == [1, 2]
    assert pipe._lean is not None


async def test_one_failing_command_fails_only_its_caller(client: aioredis.Redis, key: str) -> None:
    await client.set(key, "a string, not a hash")
    await client.script_load(APPEND.text)
    pipe = CountingPipe(client)
    other = f"{key}:other"
    answers = await asyncio.gather(
        pipe.script(APPEND, [other], ["a"]),
        pipe.hget(key, "field"),  # WRONGTYPE
        pipe.script(APPEND, [key], ["b"]),  # WRONGTYPE inside the script
        pipe.script(APPEND, [other], ["c"]),
        return_exceptions=True,
    )
    assert answers[0] == 1 and answers[3] == 2, answers
    assert isinstance(answers[1], ResponseError) and "WRONGTYPE" in str(answers[1])
    assert isinstance(answers[2], ResponseError) and "WRONGTYPE" in str(answers[2])
    assert pipe.batches == [4] and pipe._lean is not None


async def test_after_script_flush_each_script_is_loaded_once_and_its_calls_run(
    private_redis: PrivateRedis,
) -> None:
    # A Redis of this test's own: SCRIPT FLUSH empties the script cache of every client.
    client = aioredis.Redis.from_url(private_redis.url, socket_timeout=5, retry=NO_RETRY)
    loads: list[str] = []
    script_load = client.script_load

    async def counted_load(text: str) -> Any:
        loads.append(text)
        return await script_load(text)

    client.script_load = counted_load  # type: ignore[method-assign]
    try:
        pipe = CountingPipe(client)
        assert await pipe.script(APPEND, ["k"], ["before"]) == 1  # loaded once, then run
        assert loads == [APPEND.text] and pipe.batches == [1, 1]
        await client.script_flush()
        loads.clear()
        answers = await asyncio.gather(
            pipe.script(APPEND, ["k"], ["a"]),
            pipe.hget("k", "f"),  # WRONGTYPE: a list; answered in the first try
            pipe.script(APPEND, ["k"], ["b"]),
            return_exceptions=True,
        )
        assert answers[0] == 2 and answers[2] == 3, answers
        assert isinstance(answers[1], ResponseError)
        assert loads == [APPEND.text]  # one SCRIPT LOAD for the two calls
        assert pipe.batches == [1, 1, 3, 2]  # the two NOSCRIPT calls sent once more
        assert await client.lrange("k", 0, -1) == [b"before", b"a", b"b"]
        assert pipe._lean is not None
    finally:
        await client.aclose()


async def test_a_lone_command_is_on_the_wire_before_its_caller_awaits_anything(
    redis_url: str, client: aioredis.Redis, key: str
) -> None:
    await client.script_load(APPEND.text)
    pipe = AutoPipeline(client)
    await pipe.script(APPEND, [f"{key}:other"], ["warm"])  # a connection in the pool
    answer = pipe.script(APPEND, [key], ["alone"])
    await asyncio.sleep(0)  # the flush
    await asyncio.sleep(0)  # its send task's first step: the write
    # A blocking read from another client, with this loop stopped meanwhile: it can only
    # see the element if the command had left already.
    other = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        assert other.blpop([key], timeout=2) == (key.encode(), b"alone")
    finally:
        other.close()
    assert await answer == 1
    assert pipe._lean is not None


@contextlib.asynccontextmanager
async def _through_proxy(
    redis_url: str, socket_timeout: float
) -> AsyncIterator[tuple[TcpProxy, aioredis.Redis]]:
    """A proxy in front of the configured Redis (to cut or silence), and a client through it
    made as the store makes its own (no retry). The client is built from the URL, so it keeps
    the URL's db and credentials (host and port alone would write into db 0)."""
    target = urlsplit(redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    through = aioredis.Redis.from_url(
        proxy.url_for(redis_url), socket_timeout=socket_timeout, retry=NO_RETRY
    )
    try:
        yield proxy, through
    finally:
        await through.aclose()
        await proxy.close()


async def test_a_connection_lost_mid_batch_fails_that_batch_and_the_next_one_works(
    redis_url: str, client: aioredis.Redis, key: str
) -> None:
    await client.script_load(APPEND.text)
    async with _through_proxy(redis_url, 10) as (proxy, through):
        pipe = CountingPipe(through)
        assert await pipe.script(APPEND, [key], ["before"]) == 1  # connected, in the pool
        proxy.blackhole()  # the batch leaves; no answer comes back
        pipe.sending.clear()
        batch = [pipe.script(APPEND, [key], [str(i)]) for i in range(5)]
        await pipe.sending.wait()
        assert proxy.cut() == 1
        answers = await asyncio.gather(*batch, return_exceptions=True)
        assert all(isinstance(a, RedisConnectionError) for a in answers), answers
        assert not through.connection_pool._in_use_connections  # released, not leaked
        proxy.pass_traffic()
        # A new connection; its replies are its own (none left over from the lost batch).
        assert await asyncio.gather(*(pipe.script(APPEND, [key], [x]) for x in "xy")) == [2, 3]
        assert await client.lrange(key, 0, -1) == [b"before", b"x", b"y"]
        assert pipe._lean is not None


async def test_a_batch_answered_too_late_fails_with_redis_pys_timeout(
    redis_url: str, client: aioredis.Redis, key: str
) -> None:
    async with _through_proxy(redis_url, 0.3) as (proxy, through):
        pipe = AutoPipeline(through)
        assert await pipe.script(APPEND, [key], ["before"]) == 1
        proxy.blackhole()
        answers = await asyncio.gather(
            *(pipe.script(APPEND, [key], [x]) for x in "ab"), return_exceptions=True
        )
        assert all(isinstance(a, RedisTimeoutError) for a in answers), answers
        proxy.pass_traffic()
        # The late replies were never read into a later batch: that connection was closed.
        assert await pipe.script(APPEND, [f"{key}:other"], ["after"]) == 1
        assert pipe._lean is not None


async def test_a_client_whose_connections_retry_keeps_redis_pys_path(
    client: aioredis.Redis, redis_url: str, key: str
) -> None:
    retrying = aioredis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 2))
    try:
        pipe = AutoPipeline(retrying)
        assert pipe._lean is not None  # known only from its first connection
        assert await asyncio.gather(*(pipe.script(APPEND, [key], [x]) for x in "ab")) == [1, 2]
        assert pipe._lean is None  # redis-py's pipeline sent them, with its retry
        assert await pipe.script(APPEND, [key], ["c"]) == 3
    finally:
        await retrying.aclose()

"""Automatic pipelining: the store's commands issued in one event-loop iteration, sent as one.

redis-py spends most of a command's cost in Python (packing, the pool, the parser's awaits),
not in Redis; with the guard on, a worker at high concurrency saturates its event loop there.
Deliveries that run in the same loop iteration (a burst of deliveries, finishes that end
together) each issue their command here; the first one schedules a flush for the next loop
iteration (``loop.call_soon``, not a timer), which sends everything queued by then as one
non-transactional pipeline: one write, one connection from the pool, one read loop.

What stays as it was without it:
- each command is one script (or one read), atomic on its own; the pipeline adds no
  transaction and no ordering between tasks beyond the order of issue;
- a command's failure fails only its caller: the pipeline runs with ``raise_on_error=False``
  and every caller gets its own answer or its own error. Only a failed round trip (the
  connection) fails every command of that batch, as it would have failed each of them;
- a lone command is sent on the next loop iteration, directly (no pipeline object), so an
  idle worker's task waits for nothing;
- at most ``max_in_flight`` pipelines at a time (default 1): commands issued while one is
  out wait for its answers and then leave together. Under load this is what makes batches
  large (the replies of one round trip wake many deliveries, whose next commands form the
  next pipeline); when idle nothing is in flight, so nothing waits;
- at most ``max_batch`` commands per pipeline, so one huge write never delays the first
  answers of a burst for long.

It works with any client that has ``.pipeline()`` and the commands used, including a
cluster client: its pipeline routes each command to its slot's node, and a task's keys share
one hash tag, so every script still runs on one node.

The lean path (``LeanSender``). For a plain redis-py asyncio client (one Redis, or the
primary of a Sentinel set: its pool hands out connections the same way) the batch does not
go through redis-py's pipeline or command methods: redis-py's argument packing
(``pack_command``, one ``Encoder.encode`` per argument) was the costliest single item of a
guarded worker's profile. Each call is packed to RESP here when it is issued (pre-encoded
command heads, one ``bytes`` per argument, one ``b"".join``), the batch is written at once on a
connection taken from the client's own pool (``get_connection``: connected, and reconnected if
it was left dirty) after the connection's health check (a PING when it idled that long), and
each reply is read with the connection's ``read_response`` (decoding, RESP2 or RESP3,
Sentinel's "the primary became a replica" check), then the connection goes back to the pool.
Two things are cheaper than redis-py's: the write skips ``send_packed_command``'s
``wait_for`` (a task per write) when the socket takes the whole batch at once (otherwise it
drains through ``send_packed_command``, within the write timeout), and a batch's replies share
one read timeout (``socket_timeout``, raised as redis-py's ``TimeoutError``) instead of a
timer each. What redis-py does per command that matters here is kept:
a ``ResponseError`` (``NOSCRIPT``, ``WRONGTYPE``, a script's error) is that call's own answer,
as in a pipeline run with ``raise_on_error=False``; any other error (the connection, a
timeout) disconnects the connection, so no reply is left unread on it, and fails the batch.
Not kept: redis-py's response callbacks (it has none for ``EVALSHA`` and ``HGET``; a client
given one for them keeps redis-py's path), its retry of a batch after a connection error (the
store's clients are made without one, as are redis-py's own by default with a pool passed
in; a client whose connections retry keeps redis-py's path), and its OpenTelemetry metrics of
commands. A cluster client keeps redis-py's pipeline (it routes per slot).
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Enough for a worker at concurrency 100 to send a burst in one or two pipelines, small enough
# that the first caller of a batch waits for at most this many answers.
DEFAULT_MAX_BATCH = 64
# One round trip in flight per store: what is issued meanwhile waits for it and then leaves
# as one pipeline, so fewer round trips carry more commands and cost less CPU per message
# (benchmarks/README.md, "Numbers behind the code"). A lone command finds nothing in flight
# and leaves at once.
DEFAULT_MAX_IN_FLIGHT = 1
# While closing, how long a cancelled round trip may take to end before it is cancelled again.
_CLOSE_RECANCEL_S = 0.05


@dataclass(frozen=True)
class Script:
    """A Lua script known by its SHA1: sent as EVALSHA, loaded once when Redis lacks it."""

    sha: str
    text: str

    @classmethod
    def of(cls, text: str) -> Script:
        return cls(hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest(), text)


@dataclass
class _Call:
    command: str  # a client method: "evalsha", "hget", ...
    args: tuple[Any, ...]
    script: Script | None
    future: asyncio.Future[Any]
    packed: bytes = b""  # its RESP form, when the lean path sends it


class LeanSender:
    """Sends packed commands on a connection of a plain redis-py client's pool (the module's
    "lean path"). ``for_client`` says whether a client can use it."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        encoder = pool.get_encoder()
        self._encoding: str = encoder.encoding
        self._errors: str = encoder.encoding_errors
        self._encode = encoder.encode  # for arguments that are not str, bytes or int
        self._heads: dict[tuple[str, int, int], bytes] = {}

    @classmethod
    def for_client(cls, client: Any) -> LeanSender | None:
        """The lean path for ``client``, or None where redis-py's own path must stay: not a
        plain ``redis.asyncio.Redis`` (a cluster client), one connection shared by the
        client, response callbacks of the client's own for the commands sent here, or a
        redis-py older than 6.0 (its pool and retry lack what is used here)."""
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry

        if not isinstance(client, Redis) or client.single_connection_client:
            return None
        if any(name in client.response_callbacks for name in ("EVALSHA", "HGET")):
            return None
        pool = client.connection_pool
        takes = inspect.signature(pool.get_connection).parameters.values()
        if not hasattr(Retry, "get_retries") or any(
            p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in takes
        ):
            return None
        return cls(pool)

    def _bulk(self, arg: Any) -> bytes:
        kind = type(arg)
        if kind is str:
            data: Any = arg.encode(self._encoding, self._errors)
        elif kind is bytes:
            data = arg
        elif kind is int:
            data = b"%d" % arg
        else:  # redis-py's own rules: a float, a bytearray; DataError for a bool or a list
            data = self._encode(arg)
        return b"$%d\r\n%b\r\n" % (len(data), data)

    def pack_script(self, sha: str, keys: list[Any], args: list[Any]) -> bytes:
        """``EVALSHA sha len(keys) *keys *args`` in RESP."""
        shape = (sha, len(keys), len(args))
        head = self._heads.get(shape)
        if head is None:  # once per script and shape of call
            head = self._heads[shape] = b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (
                3 + len(keys) + len(args),
                self._bulk(sha),
                self._bulk(len(keys)),
            )
        bulk = self._bulk
        return b"".join([head, *[bulk(k) for k in keys], *[bulk(a) for a in args]])

    def pack_hget(self, key: Any, field: Any) -> bytes:
        return b"*3\r\n$4\r\nHGET\r\n" + self._bulk(key) + self._bulk(field)

    def pack_smembers(self, key: Any) -> bytes:
        return b"*2\r\n$8\r\nSMEMBERS\r\n" + self._bulk(key)

    async def execute(self, packed: list[bytes]) -> list[Any] | None:
        """Each command's reply, or its ``ResponseError`` as a value; None when the
        connection retries commands (then redis-py's own path must send them)."""
        pool = self._pool
        conn = await pool.get_connection()
        try:
            if conn.retry.get_retries():
                return None
            await _write(conn, b"".join(packed))
            timeout = conn.socket_timeout
            if not timeout:
                return await _read(conn, len(packed), None)
            # One read timeout for the batch's replies, not a timer per reply: Redis
            # answers a batch's scripts together (the timeout is seconds; a batch runs in
            # well under a millisecond).
            try:
                async with asyncio.timeout(timeout):
                    return await _read(conn, len(packed), math.inf)
            except builtins.TimeoutError:  # redis-py's own error, as for a reply too late
                raise RedisTimeoutError(f"Timeout reading from {conn._host_error()}") from None
        except BaseException:
            # A failed write or read, a timeout, a cancellation: replies may be left unread
            # on the socket, so the connection must not serve anyone again as it is.
            await conn.disconnect(nowait=True)
            raise
        finally:
            await pool.release(conn)


async def _write(conn: Any, data: bytes) -> None:
    """``conn.send_packed_command(data)``, without its write timeout's task when the socket
    takes all of ``data`` at once (the usual case: a batch is a few KiB)."""
    if conn.health_check_interval:
        await conn.check_health()  # a PING when the connection idled that long
    writer = getattr(conn, "_writer", None)
    if writer is None or writer.transport.is_closing():
        await conn.send_packed_command(data, check_health=False)  # its errors, its way
        return
    writer.write(data)
    if writer.transport.get_write_buffer_size():
        # Not all of it went out: wait for the rest within the write timeout, and fail
        # (disconnected) as redis-py does.
        await conn.send_packed_command(b"", check_health=False)


async def _read(conn: Any, count: int, read_timeout: float | None) -> list[Any]:
    answers: list[Any] = []
    for _ in range(count):
        try:
            answers.append(await conn.read_response(timeout=read_timeout))
        except ResponseError as e:  # this command's own failure
            answers.append(e)
    return answers


class AutoPipeline:
    """Sends the commands queued in one loop iteration as one pipeline (see the module)."""

    def __init__(
        self,
        client: Any,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        lean: bool = True,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ValueError(
                f"max_batch and max_in_flight must be at least 1, not {max_batch}, {max_in_flight}"
            )
        self._client = client
        self._lean = LeanSender.for_client(client) if lean else None
        # A Redis Cluster client's pipelines run a script by its text (state.redis_clients):
        # looked up once here, not per command.
        self._script_texts: dict[str, Any] | None = getattr(client, "script_texts", None)
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self._queued: list[_Call] = []
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # where a flush is due
        self._sending: set[asyncio.Task[None]] = set()
        # What was sent, for the benchmark and for tuning: commands / round trips.
        self.sent_commands = 0
        self.round_trips = 0

    # Plain functions returning the caller's future: no coroutine per command on the hot path.
    def script(self, script: Script, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """EVALSHA of ``script`` with ``keys`` and ``args``, in the next pipeline."""
        if self._script_texts is not None:  # a cluster client: its pipelines send EVAL
            self._script_texts.setdefault(script.sha, script.text)
        lean = self._lean
        # Packed now, so an argument redis-py would refuse fails its own caller only.
        packed = lean.pack_script(script.sha, keys, args) if lean is not None else b""
        return self._queue("evalsha", (script.sha, len(keys), *keys, *args), script, packed)

    def hget(self, key: str, field: str) -> asyncio.Future[Any]:
        lean = self._lean
        packed = lean.pack_hget(key, field) if lean is not None else b""
        return self._queue("hget", (key, field), None, packed)

    def smembers(self, key: str) -> asyncio.Future[Any]:
        """The members (a set, or a list on the lean path: callers iterate them)."""
        lean = self._lean
        packed = lean.pack_smembers(key) if lean is not None else b""
        return self._queue("smembers", (key,), None, packed)

    def _queue(
        self, command: str, args: tuple[Any, ...], script: Script | None, packed: bytes
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        call = _Call(command, args, script, loop.create_future(), packed)
        self._queued.append(call)
        # Scheduled on this loop, not merely "scheduled": a flush left pending on a loop that
        # was closed since (a store reused across asyncio.run calls) would never run.
        if self._flush_loop is not loop:
            self._flush_loop = loop
            loop.call_soon(self._flush, loop)
        return call.future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._flush_loop = None
        # A caller cancelled before its batch left is dropped: it no longer waits for it;
        # so is one of another loop (closed), and a round trip that loop left unfinished.
        calls = [c for c in self._queued if not c.future.done() and c.future.get_loop() is loop]
        self._sending = {t for t in self._sending if t.get_loop() is loop}
        while calls and len(self._sending) < self.max_in_flight:
            batch, calls = calls[: self.max_batch], calls[self.max_batch :]
            task = loop.create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sent)
        # The rest waits for a round trip to end, and then goes out as one pipeline.
        self._queued = calls

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        loop = task.get_loop()
        if self._queued and self._flush_loop is not loop and not loop.is_closed():
            self._flush_loop = loop
            loop.call_soon(self._flush, loop)

    async def _send(self, calls: list[_Call]) -> None:
        try:
            pairs = list(zip(calls, await self._execute(calls), strict=True))
            missing = [c for c, a in pairs if isinstance(a, NoScriptError)]
            self._answer([(c, a) for c, a in pairs if not isinstance(a, NoScriptError)])
            if missing:
                # Redis lost its script cache (a restart, SCRIPT FLUSH, a new node): load
                # each script once and send those calls again. Their first try ran nothing;
                # the others have their answers already, whatever happens to these.
                for text in {s.text for c in missing if (s := c.script)}:
                    await self._client.script_load(text)
                self._answer(list(zip(missing, await self._execute(missing), strict=True)))
        except asyncio.CancelledError:  # closed: its callers are let go, as if cancelled
            for call in calls:
                call.future.cancel()
            raise
        except Exception as e:  # the round trip itself failed: every caller still waiting
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(e)

    @staticmethod
    def _answer(answered: list[tuple[_Call, Any]]) -> None:
        for call, answer in answered:
            if call.future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(answer, Exception):
                call.future.set_exception(answer)
            else:
                call.future.set_result(answer)

    async def _execute(self, calls: list[_Call]) -> list[Any]:
        """Each call's answer, or its error as a value (never raised for one command)."""
        self.sent_commands += len(calls)
        self.round_trips += 1
        lean = self._lean
        if lean is not None:
            sent = await lean.execute([call.packed for call in calls])
            if sent is not None:
                return sent
            self._lean = None  # its connections retry: redis-py's path from now on
        if len(calls) == 1:
            # Alone: the plain command, without building a pipeline (today's cost).
            call = calls[0]
            try:
                return [await getattr(self._client, call.command)(*call.args)]
            except NoScriptError as e:
                return [e]
        async with self._client.pipeline(transaction=False) as pipe:
            for call in calls:
                getattr(pipe, call.command)(*call.args)
            answers: list[Any] = await pipe.execute(raise_on_error=False)
            return answers

    async def close(self) -> None:
        """Stop: what is queued or in flight is dropped and its callers are cancelled.

        The owner closes once its users stopped (a worker drains its handlers first); a
        Redis that does not answer must not hold a close for its socket timeout.
        """
        for call in self._queued:
            call.future.cancel()
        self._queued = []
        pending = set(self._sending)
        # Cancelled again until it ends: on Python 3.11, asyncio.wait_for (which redis-py
        # wraps around each socket write, its connect's HELLO and PING included) swallows a
        # cancellation that arrives as the write completes, and the task then waits for a
        # reply for the whole socket timeout (seen: Ctrl-C of `weclaw-mq status --wait`
        # against a Redis that accepts and never answers hung for 60 s). A second cancel
        # reaches the read that follows.
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=_CLOSE_RECANCEL_S)

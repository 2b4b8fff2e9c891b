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
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

# Enough for a worker at concurrency 100 to send a burst in one or two pipelines, small enough
# that the first caller of a batch waits for at most this many answers.
DEFAULT_MAX_BATCH = 64
# One round trip in flight per store: what is issued meanwhile waits for it and then leaves
# as one pipeline. Measured in the benchmark (consume c=100, guard + results): commands per
# round trip 6 with no bound, 17 with 2 in flight, 33 with 1; CPU per message about 300, 252
# and 211 us (one run each, a loaded machine). A lone command finds nothing in flight and
# leaves at once.
DEFAULT_MAX_IN_FLIGHT = 1


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


class AutoPipeline:
    """Sends the commands queued in one loop iteration as one pipeline (see the module)."""

    def __init__(
        self,
        client: Any,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ValueError(
                f"max_batch and max_in_flight must be at least 1, not {max_batch}, {max_in_flight}"
            )
        self._client = client
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
        return self._queue("evalsha", (script.sha, len(keys), *keys, *args), script)

    def hget(self, key: str, field: str) -> asyncio.Future[Any]:
        return self._queue("hget", (key, field), None)

    def _queue(
        self, command: str, args: tuple[Any, ...], script: Script | None
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        call = _Call(command, args, script, loop.create_future())
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
        sending = list(self._sending)
        for task in sending:
            task.cancel()
        await asyncio.gather(*sending, return_exceptions=True)

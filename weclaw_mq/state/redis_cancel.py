"""Cancellation on Redis (the rules are in ``state.cancel_records``): the cancel script, the marker
read, and the one subscription per worker to cancel requests; and the store's cancel methods
(``RedisCancelling``, which ``RedisTaskStore`` inherits).

Redis errors escape ``RedisCancels`` as redis-py raises them: ``RedisCancelling`` wraps them
at the store's boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from weclaw_mq.contract.naming import (
    CANCEL_CHANNEL,
    cancel_key,
    done_channel,
    latest_key,
    state_key,
)
from weclaw_mq.errors import StateUnavailableError
from weclaw_mq.state.cancel_records import (
    CANCEL_ATTEMPTS,
    answer,
    cancelled_record,
    covers,
    finished,
    other_record,
    read_request,
    request_message,
    scope_of,
)
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import AutoPipeline
from weclaw_mq.state.protocol import Cancellation, CancelOutcome, TaskState, TaskStore
from weclaw_mq.state.redis_clients import REDIS_FAILURES, StateClient
from weclaw_mq.state.redis_index import RedisTaskIndex
from weclaw_mq.state.redis_wakeups import RECHECK_S as _RECHECK_S

log = logging.getLogger("weclaw_mq.state")

# The records a cancel decides on, in one round trip. KEYS: latest[, record]. Returns
# {record key, state JSON, latest pointer, latest state JSON}, '' for what does not exist
# (the latest ones only when the record named is absent: state.cancel_records.other_record). The key
# the pointer names is not in KEYS: on one Redis that is fine, and under a cluster the hash
# tag keeps it on this node.
_READ = """
local latest = redis.call('GET', KEYS[1]) or ''
local key = KEYS[2] or latest
if key == '' then return {'', '', '', ''} end
local state = redis.call('HGET', key, 'state') or ''
local other = ''
if state == '' and latest ~= '' and latest ~= key then
  other = redis.call('HGET', latest, 'state') or ''
end
return {key, state, latest, other}
"""

# The cancel, if the record is still the one read (compare and set): marker, cancelled
# record, wake-ups. Prefixed with the shared record-write rule (``write_record``).
# KEYS: marker, latest[, record]. ARGV: scope, expected state ('' = none), expected latest
# pointer ('-' = not checked: the queue was given), cancelled state ('' = none to write),
# ttl_ms, done channel, queue, cancel channel, request[, timeline event, index member].
# Returns 1, or 0 when it changed.
_CANCEL = """
local current = ''
if KEYS[3] then current = redis.call('HGET', KEYS[3], 'state') or '' end
if current ~= ARGV[2] then return 0 end
if ARGV[3] ~= '-' and (redis.call('GET', KEYS[2]) or '') ~= ARGV[3] then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[4] ~= '' then
  write_record(KEYS[3], KEYS[2], 'cancelled', ARGV[4], ARGV[5], false, ix_at(10))
  redis.call('PUBLISH', ARGV[6], ARGV[7])
end
redis.call('PUBLISH', ARGV[8], ARGV[9])
return 1
"""

# How long one wait for a request lasts: bounded, because a blocking read of a pub/sub
# connection would hit the pool's socket timeout (redis-py applies it to block=True reads).
_LISTEN_POLL_S = 1.0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisCancels:
    """``record_write_lua``: the store's shared record-write rule, which the cancel script
    uses to write the cancelled record (passed in: that rule lives with the store).
    ``pipe``: the store's auto-pipeline, for the marker read on a delivery's path. ``index``:
    the store's task index, whose keys the cancelled record's write carries."""

    def __init__(
        self,
        client: StateClient,
        *,
        ttl_ms: int,
        record_write_lua: str,
        pipe: AutoPipeline | None = None,
        index: RedisTaskIndex | None = None,
    ) -> None:
        self._redis = client
        self._pipe = pipe
        self._index = index
        self._ttl_ms = ttl_ms
        self._read = client.register_script(_READ)
        self._cancel = client.register_script(record_write_lua + _CANCEL)

    async def cancel(self, task_id: str, queue: str | None) -> Cancellation:
        for _ in range(CANCEL_ATTEMPTS):
            record_keys = [state_key(queue, task_id)] if queue is not None else []
            key, raw, latest, raw_other = (
                _text(v) for v in await self._read(keys=[latest_key(task_id), *record_keys])
            )
            state = TaskState.model_validate_json(raw) if raw else None
            other = other_record(
                state, TaskState.model_validate_json(raw_other) if raw_other else None, queue
            )
            now = datetime.now(UTC)
            done = finished(state, now)
            if done is not None:
                return Cancellation(task_id, CancelOutcome.FINISHED, done)
            written = cancelled_record(state, task_id, queue, now, other=other)
            args: list[str | int] = [
                scope_of(queue),
                raw,
                # With a queue and no record there, the pointer too: nothing was recorded
                # elsewhere since the read (other_record decided on it).
                "-" if queue is not None and state is not None else latest,
                written.model_dump_json() if written is not None else "",
                self._ttl_ms,
                done_channel(task_id),
                written.queue if written is not None else "",
                CANCEL_CHANNEL,
                request_message(task_id, queue),
            ]
            keys = [cancel_key(task_id), latest_key(task_id), *([key] if key else [])]
            if key and written is not None and self._index is not None:
                args += self._index.block(written)
            if await self._cancel(keys=keys, args=args):
                if self._index is not None:
                    await self._index.settled()  # a cluster's index write, sent beside it
                return answer(task_id, written, other)
        raise StateUnavailableError(
            f"the record of task {task_id} changed under {CANCEL_ATTEMPTS} cancels in a row; "
            "try again"
        )

    async def is_cancelled(self, queue: str, task_id: str) -> bool:
        key = cancel_key(task_id)
        # Through the pipeline: read per delivery of an unguarded handler, so concurrent
        # reads share one connection instead of taking one each.
        pipe = self._pipe
        members = await (pipe.smembers(key) if pipe is not None else self._redis.smembers(key))
        return covers({_text(m) for m in members}, queue)

    async def listen(
        self,
        on_cancel: Callable[[str, str | None], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        """Subscribe, call ``on_subscribed``, then pass every request to ``on_cancel``, until
        cancelled or Redis fails (raised: the caller subscribes again)."""
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(CANCEL_CHANNEL)
            await on_subscribed()
            while True:
                message = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=_LISTEN_POLL_S
                )
                if message is None or message.get("type") != "message":
                    continue
                request = read_request(message["data"])
                if request is not None:
                    on_cancel(*request)
        finally:
            # aclose alone (see RedisTaskStore._wait): it returns the connection to the pool.
            with contextlib.suppress(Exception):  # already broken: nothing left to return
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


class RedisCancelling(TaskStore):
    """The Redis task store's cancel methods (``RedisTaskStore`` inherits them): each is one
    call to its ``RedisCancels``, with redis-py's errors turned into ``StateUnavailableError``."""

    _cancels: RedisCancels  # set by RedisTaskStore.__init__

    async def cancel(self, task_id: str, *, queue: str | None = None) -> Cancellation:
        try:
            return await self._cancels.cancel(task_id, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def is_cancelled(self, queue: str, task_id: str) -> bool:
        try:
            return await self._cancels.is_cancelled(queue, task_id)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def watch_cancels(
        self,
        on_cancel: Callable[[str, str | None], None],
        on_subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        # A failed subscription is logged (once per outage) and made again, with backoff.
        failures = 0

        async def subscribed() -> None:
            nonlocal failures
            if failures:
                log.info("cancel requests heard again after %d failed subscription(s)", failures)
            failures = 0
            await on_subscribed()

        while True:
            try:
                await self._cancels.listen(on_cancel, subscribed)
            except Exception as e:  # Redis failing, or on_subscribed's reads: listen again
                failures += 1
                delay_s = min(0.1 * 2**failures, _RECHECK_S)
                # Once per outage: a retry every 2 s would fill the log with one fact.
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "cancel requests unheard (%s: %s); subscribing again every %.1f s or less",
                    type(e).__name__,
                    e,
                    _RECHECK_S,
                )
                await asyncio.sleep(delay_s)

"""The idempotency guard: each task id's handler runs once per queue, however often it arrives.

One Redis key per (queue, task id) (``naming.guard_key``), in one of two states:
- ``running:<owner>`` with a lease (PX): a worker holds the task. The lease is renewed every
  third of its length while the handler runs, so a minute-long model call is not taken by a
  second worker; if the holder dies, the lease lapses and a redelivered copy may claim it.
- ``done`` with a TTL (``done_ttl_s``): the result is stored; copies are acked unrun.

Claims are one atomic script around ``SET NX``, never check-then-set; with the default result
store the claim also writes the task's "running" record in the same step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator
from enum import StrEnum

import redis.asyncio as aioredis

from .naming import guard_key
from .results import RECORD_WRITE_LUA, DoneMarker, RecordWrite

log = logging.getLogger("weclaw_mq.guard")

DONE = "done"
_RUNNING = "running:"


class Claim(StrEnum):
    ACQUIRED = "acquired"
    DONE = "done"  # finished before: ack without running
    BUSY = "busy"  # another worker holds it now: come back later


# SET NX, never check-then-set. A lease that lapses between the SET and the GET reads as busy:
# the next delivery claims it.
_CLAIM = (
    RECORD_WRITE_LUA
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if KEYS[2] then write_record(KEYS[2], KEYS[3], ARGV[4], ARGV[5], ARGV[6], false) end
  return 'acquired'
end
if redis.call('GET', KEYS[1]) == ARGV[3] then return 'done' end
return 'busy'
"""
)

# Only the holder may renew or release its lease.
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class IdempotencyGuard:
    def __init__(self, client: aioredis.Redis, *, lease_s: float, done_ttl_s: float) -> None:
        self._redis = client
        self.lease_s = lease_s
        self._lease_ms = int(lease_s * 1000)
        self._done_ttl_ms = int(done_ttl_s * 1000)
        self._claim = client.register_script(_CLAIM)
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)
        self._held: dict[str, str] = {}  # guard key -> owner token, while its handler runs
        self._renewer: asyncio.Task[None] | None = None

    @staticmethod
    def new_owner() -> str:
        return f"{_RUNNING}{uuid.uuid4().hex}"

    async def claim(
        self, queue: str, task_id: str, owner: str, *, record: RecordWrite | None = None
    ) -> Claim:
        """Claim the task for ``owner``; with ``record``, write it (the "running" status) in
        the same step when the claim is granted: one round trip, one command."""
        keys = [guard_key(queue, task_id)]
        args: list[str | int] = [owner, self._lease_ms, DONE]
        if record is not None:
            keys += [record.key, record.latest]
            args += [record.status, record.state, record.ttl_ms]
        answer = await self._claim(keys=keys, args=args)
        return Claim(answer.decode() if isinstance(answer, bytes) else answer)

    async def release(self, queue: str, task_id: str, owner: str) -> None:
        await self._release(keys=[guard_key(queue, task_id)], args=[owner])

    def done_marker(self, queue: str, task_id: str) -> DoneMarker:
        return DoneMarker(guard_key(queue, task_id), DONE, self._done_ttl_ms)

    async def mark_done(self, queue: str, task_id: str) -> None:
        await self._redis.set(guard_key(queue, task_id), DONE, px=self._done_ttl_ms)

    @contextlib.contextmanager
    def holding(self, queue: str, task_id: str, owner: str) -> Iterator[None]:
        """Keep the lease renewed while the body runs.

        One renewer serves every lease of the process, in one pipelined round trip per
        period, instead of a task and a timer per message.
        """
        key = guard_key(queue, task_id)
        self._held[key] = owner
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_while_held())
        try:
            yield
        finally:
            if self._held.get(key) == owner:
                del self._held[key]

    async def _renew_while_held(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            if not self._held:
                # No await between this check and the return: a new holder either came
                # before it (we go on) or sees no renewer and starts one.
                self._renewer = None
                return
            held = list(self._held.items())
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key, owner in held:
                        await self._extend(keys=[key], args=[owner, self._lease_ms], client=pipe)
                    renewed = await pipe.execute()
            except Exception as e:  # a Redis blip must not kill the handlers
                log.warning("could not renew %d lease(s) (%s: %s)", len(held), type(e).__name__, e)
                continue
            for (key, owner), ok in zip(held, renewed, strict=True):
                if not ok and self._held.get(key) == owner:
                    log.warning(
                        "lost the lease on %s (it lapsed or was taken); another worker may "
                        "run the task too",
                        key,
                    )

    async def close(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

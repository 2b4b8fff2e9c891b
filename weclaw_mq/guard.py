"""The idempotency guard: each task id's handler runs once per queue, however often it arrives.

One Redis key per (queue, task id), in one of two states:
- ``running:<owner>`` with a lease (PX): a worker holds the task. The lease is renewed while
  the handler runs, so a minute-long model call is not taken by a second worker; if the
  holder dies, the lease lapses and a redelivered copy may claim it.
- ``done`` with a TTL (``done_ttl_s``): the result is stored; copies are acked unrun.

Claims are one atomic ``SET NX``, never check-then-set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from enum import StrEnum

import redis.asyncio as aioredis

from .naming import guard_key

log = logging.getLogger("weclaw_mq.guard")

DONE = "done"
_RUNNING = "running:"


class Claim(StrEnum):
    ACQUIRED = "acquired"
    DONE = "done"  # finished before: ack without running
    BUSY = "busy"  # another worker holds it now: come back later


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
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)

    @staticmethod
    def new_owner() -> str:
        return f"{_RUNNING}{uuid.uuid4().hex}"

    async def claim(self, queue: str, task_id: str, owner: str) -> Claim:
        key = guard_key(queue, task_id)
        if await self._redis.set(key, owner, nx=True, px=self._lease_ms):
            return Claim.ACQUIRED
        current = await self._redis.get(key)
        if current is None:
            # The holder's lease lapsed between our two calls: let the next delivery claim.
            return Claim.BUSY
        return Claim.DONE if current == DONE.encode() else Claim.BUSY

    async def extend(self, queue: str, task_id: str, owner: str) -> bool:
        return bool(
            await self._extend(keys=[guard_key(queue, task_id)], args=[owner, self._lease_ms])
        )

    async def release(self, queue: str, task_id: str, owner: str) -> None:
        await self._release(keys=[guard_key(queue, task_id)], args=[owner])

    async def mark_done(self, queue: str, task_id: str) -> None:
        await self._redis.set(guard_key(queue, task_id), DONE, px=self._done_ttl_ms)

    @contextlib.asynccontextmanager
    async def lease_kept(self, queue: str, task_id: str, owner: str) -> AsyncIterator[None]:
        """Renew the lease every third of its length while the body runs."""
        keeper = asyncio.create_task(self._keep(queue, task_id, owner))
        try:
            yield
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def _keep(self, queue: str, task_id: str, owner: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if not await self.extend(queue, task_id, owner):
                    log.warning(
                        "lost the lease on task %s (it lapsed or was taken); another worker "
                        "may run it too",
                        task_id,
                    )
                    return
            except Exception as e:  # Redis blips must not kill the handler
                log.warning("could not renew the lease (%s: %s)", type(e).__name__, e)

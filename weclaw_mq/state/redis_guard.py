"""The Redis task store's guard: the claim, its lease (renewed for every held claim by one
task per store), this worker's heartbeat that every claim names, the release and the finish
(``RedisTaskStore`` inherits these methods; ``state.redis`` says how they fit together).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

from weclaw_mq.contract.naming import (
    cancel_key,
    done_channel,
    guard_key,
    heartbeat_key,
    watch_key,
)
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import Script
from weclaw_mq.state.protocol import Claim, Finish, TaskState
from weclaw_mq.state.redis_clients import REDIS_FAILURES
from weclaw_mq.state.redis_records import RedisRecords
from weclaw_mq.state.watches import WatchStep

log = logging.getLogger("weclaw_mq.state")

# The guard key's value: "done", or "running:<owner>@<worker id>" while an attempt holds it
# (a value without "@<worker id>", of an older worker, holds until its lease lapses).
DONE = "done"
_RUNNING = "running:"
_OF_WORKER = "@"

# Every answer the claim script gives, as str and as bytes (decode_responses or not).
_CLAIMS: dict[str | bytes, Claim] = {
    **{c.value: c for c in Claim},
    **{c.value.encode(): c for c in Claim},
}
_FINISHES: dict[str | bytes, Finish] = {
    **{f.value: f for f in Finish},
    **{f.value.encode(): f for f in Finish},
}


class RedisGuard(RedisRecords):
    """The guard's claims on Redis; the claim and the finish write records too (hence the base)."""

    # Set by RedisTaskStore.__init__.
    lease_s: float
    worker_id: str
    heartbeat_ttl_s: float
    _lease_ms: int
    _done_ttl_ms: int
    _claim: Script
    _watched_claim: Script
    _watch_set: Script
    _finish: Script
    _release: Script
    _extend: Script
    _beat: Script
    _alive: Script
    _held: dict[str, str]
    _renewer: asyncio.Task[None] | None
    _heartbeat_ttl_ms: int
    _heartbeat_key: str
    _heartbeat_value: str
    _of_worker: str
    _alive_until: float
    _beating: asyncio.Future[Any] | None

    async def claim(
        self,
        queue: str,
        task_id: str,
        owner: str,
        *,
        running: TaskState | None = None,
        watch: int | None = None,
    ) -> Claim:
        keys = [guard_key(queue, task_id), cancel_key(task_id)]
        args: list[str | int] = [_RUNNING + owner + self._of_worker, self._lease_ms, DONE, queue]
        if running is not None:
            keys += self._record_keys(running)
            args += [running.status.value, running.model_dump_json(), self._ttl_ms]
            args += self.index.block(running)
        tail: list[str | int]
        # A watch copy's claim reads the watch key in the same step (its prelude takes the
        # last key and argument off): a copy made stale just before never claims.
        script, tail = self._claim, []
        if watch is not None:
            script, tail = self._watched_claim, [watch]
            keys.append(watch_key(queue, task_id))
        self._renewing()
        try:
            # The claim names our heartbeat: on the first claims (or after the renewer could
            # not beat for a while) it is written just before, in the same batch.
            beat = self._beat_for_claims()
            answer = await self._pipe.script(script, keys, args + tail)
            if beat is not None:
                await beat
            # A dict lookup, not Claim(value): an enum call by value costs several Python
            # calls on every guarded delivery (Python 3.11).
            claim = _CLAIMS.get(answer)
            if claim is not None:
                return claim
            return await self._claim_from(answer, script, keys, args, tail)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _claim_from(
        self,
        holder: Any,
        script: Script,
        keys: list[str],
        args: list[str | int],
        tail: list[str | int],
    ) -> Claim:
        """Busy: take the claim over if its holder's worker is gone (no heartbeat), else
        ``Claim.BUSY``. Only a copy of a task someone holds pays these round trips."""
        text = holder.decode() if isinstance(holder, bytes) else str(holder)
        if not text.startswith(_RUNNING):
            return Claim(text)  # an answer this code does not know: ValueError
        worker = text.rpartition(_OF_WORKER)[2] if _OF_WORKER in text else self.worker_id
        if worker == self.worker_id:  # ours (alive), or of an older worker: its lease rules
            return Claim.BUSY
        if await self._pipe.script(self._alive, [heartbeat_key(worker)], []):
            return Claim.BUSY
        again = _CLAIMS.get(await self._pipe.script(script, keys, [*args, holder, *tail]))
        if again is None:  # another copy took it over first
            return Claim.BUSY
        if again is Claim.ACQUIRED:
            log.info("took over the claim on %s from worker %s, which is gone", keys[0], worker)
        return again

    def _beat_for_claims(self) -> asyncio.Future[Any] | None:
        """None while our heartbeat surely lives on; else the beat to send (one, shared by
        the claims issued meanwhile)."""
        if time.monotonic() <= self._alive_until - self.heartbeat_ttl_s / 2:
            return None
        beating = self._beating
        if (
            beating is None
            or beating.done()
            or beating.get_loop() is not asyncio.get_running_loop()
        ):
            beating = self._beating = self._send_beat()
        return beating

    def _send_beat(self) -> asyncio.Future[Any]:
        sent = time.monotonic()
        beat = self._pipe.script(
            self._beat, [self._heartbeat_key], [self._heartbeat_value, self._heartbeat_ttl_ms]
        )
        beat.add_done_callback(functools.partial(self._beaten, sent))
        return beat

    def _beaten(self, sent: float, beat: asyncio.Future[Any]) -> None:
        if not beat.cancelled() and beat.exception() is None:
            self._alive_until = max(self._alive_until, sent + self.heartbeat_ttl_s)

    def _renewing(self) -> None:
        """The renewer runs on this loop: started on first use, and again on a new loop (a
        store reused under another ``asyncio.run``: the old loop's task is dead with it)."""
        loop = asyncio.get_running_loop()
        renewer = self._renewer
        if renewer is None or renewer.get_loop() is not loop or renewer.done():
            self._renewer = loop.create_task(self._renew())

    @contextlib.contextmanager
    def holding(self, queue: str, task_id: str, owner: str) -> Iterator[None]:
        # No timer of its own: the store's renewer extends every held lease in one batch.
        key, value = guard_key(queue, task_id), _RUNNING + owner + self._of_worker
        self._held[key] = value
        self._renewing()
        try:
            yield
        finally:
            if self._held.get(key) == value:
                del self._held[key]

    async def _renew(self) -> None:
        """Until the store closes (or its loop ends): our heartbeat every third of its TTL,
        and every held lease every third of the lease, together in one batch."""
        tick_s = min(self.heartbeat_ttl_s, self.lease_s) / 3
        beat_due = leases_due = time.monotonic() + tick_s
        failing = 0
        while True:
            await asyncio.sleep(max(0.0, min(beat_due, leases_due) - time.monotonic()))
            now = time.monotonic()
            beat = now >= beat_due
            held = list(self._held.items()) if now >= leases_due else []
            if beat:
                beat_due = now + self.heartbeat_ttl_s / 3
            if now >= leases_due:
                leases_due = now + self.lease_s / 3
            try:
                # Issued together: one pipeline (or several of at most max_batch), and no
                # SCRIPT EXISTS round trip first, as redis-py's own pipeline of scripts makes.
                renewed = await asyncio.gather(
                    *([self._send_beat()] if beat else []),
                    *(
                        self._pipe.script(self._extend, [k], [v, self._lease_ms, DONE])
                        for k, v in held
                    ),
                )
            except Exception as e:  # a Redis blip must not kill the handlers
                if not failing:  # once per outage, not every tick
                    log.warning(
                        "could not renew this worker's heartbeat and %d lease(s) (%s: %s); "
                        "others take its claims over if this lasts %.3g s",
                        len(held),
                        type(e).__name__,
                        e,
                        max(0.0, self._alive_until - time.monotonic()),
                    )
                failing += 1
                continue
            if failing:
                log.info("renewed the heartbeat and leases again after %d failed tries", failing)
                failing = 0
            for (key, value), ok in zip(held, renewed[len(renewed) - len(held) :], strict=True):
                if not ok and self._held.get(key) == value:
                    log.warning(
                        "lost the lease on %s (it lapsed or was taken); another worker may "
                        "run the task too",
                        key,
                    )

    async def watch(self, queue: str, task_id: str, generation: int, step: WatchStep) -> int:
        keys, args = [watch_key(queue, task_id)], [generation, step.value, self._ttl_ms]
        try:
            return int(await self._pipe.script(self._watch_set, keys, args))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def release(self, queue: str, task_id: str, owner: str) -> None:
        key, value = guard_key(queue, task_id), _RUNNING + owner + self._of_worker
        if self._held.get(key) == value:
            del self._held[key]  # given up: no renewal may find it gone and cry "lost"
        try:
            await self._pipe.script(self._release, [key], [value])
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def finish(
        self, queue: str, task_id: str, result: TaskState | None, *, owner: str | None = None
    ) -> Finish:
        key = guard_key(queue, task_id)
        keys = [key]
        args: list[str | int] = [DONE, self._done_ttl_ms]
        if result is not None:
            keys += self._record_keys(result)
            args += [
                result.status.value,
                result.model_dump_json(),
                self._ttl_ms,
                done_channel(result.task_id),
                result.queue,
                *self.index.block(result),
            ]
        value = None if owner is None else _RUNNING + owner + self._of_worker
        if value is not None:
            args.append(value)
        try:
            answer = await self._pipe.script(self._finish, keys, args)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        # Held (renewed) until the finish returned: a result write that retries keeps it.
        if value is not None and self._held.get(key) == value:
            del self._held[key]
        finish = _FINISHES.get(answer)
        return finish if finish is not None else Finish(answer)

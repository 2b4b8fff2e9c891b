"""The Redis task store's records: a task's record per queue written through the one
record-write rule (``state.redis.RECORD_WRITE_LUA``), read, waited for, and dropped when its
publish was refused; and a body's fingerprint (``RedisTaskStore`` inherits these methods).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from typing import Any

from redis.commands.core import AsyncScript

from weclaw_mq.contract.naming import body_key, done_channel, latest_key, state_key
from weclaw_mq.errors import ResultTimeoutError
from weclaw_mq.state.expiry import record_ttl_s
from weclaw_mq.state.outages import state_unavailable
from weclaw_mq.state.pipelining import AutoPipeline, Script
from weclaw_mq.state.protocol import RecordsSoon, TaskState, TaskStatus, TaskStore
from weclaw_mq.state.redis_clients import REDIS_FAILURES, StateClient
from weclaw_mq.state.redis_index import RedisTaskIndex
from weclaw_mq.state.redis_wakeups import RECHECK_S as _RECHECK_S
from weclaw_mq.state.redis_wakeups import LoopWakeups
from weclaw_mq.state.reuse import FingerprintStore
from weclaw_mq.state.transitions import narrowing


def _only_over_arg(only_over: Collection[TaskStatus] | None) -> str:
    """``only_over`` as the record script's argument ('-': not narrowed)."""
    return "-" if only_over is None else " ".join(sorted(s.value for s in only_over))


class RedisRecords(TaskStore, FingerprintStore, RecordsSoon):
    """A task's records on Redis, and the wake-ups of those who wait for one to turn final."""

    # Set by RedisTaskStore.__init__.
    index: RedisTaskIndex
    _redis: StateClient
    _pipe: AutoPipeline
    _cluster: bool
    _ttl_ms: int
    _record: Script
    _record_new_many: AsyncScript
    _forget_queued: Script
    _get_latest: Script
    _keep_fingerprint: Script
    _wakeups: LoopWakeups

    @staticmethod
    def _record_keys(state: TaskState) -> list[str]:
        return [state_key(state.queue, state.task_id), latest_key(state.task_id)]

    def _record_ttl_ms(self, state: TaskState) -> int:
        return int(record_ttl_s(state, self._ttl_ms / 1000, datetime.now(UTC)) * 1000)

    def _record_call(self, state: TaskState, only_over: str) -> tuple[list[str], list[Any]]:
        """The record script's KEYS and ARGV for writing ``state``."""
        return self._record_keys(state), [
            state.status.value,
            state.model_dump_json(),
            self._record_ttl_ms(state),
            only_over,
            done_channel(state.task_id),
            state.queue,
            *self.index.block(state),
        ]

    async def record(
        self,
        state: TaskState,
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> bool:
        over = _only_over_arg(narrowing(only_if_new, only_over))
        keys, args = self._record_call(state, over)
        try:
            return bool(await self._pipe.script(self._record, keys, args))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    def record_soon(self, state: TaskState, *, only_if_new: bool = False) -> asyncio.Future[Any]:
        # Sent with the auto-pipeline's next batch: no task of its own, a round trip sooner.
        over = _only_over_arg(narrowing(only_if_new, None))
        return self._pipe.script(self._record, *self._record_call(state, over))

    async def record_many(
        self,
        states: Sequence[TaskState],
        *,
        only_if_new: bool = False,
        only_over: Collection[TaskStatus] | None = None,
    ) -> None:
        if not states:
            return
        try:
            await self._record_many(states, only_if_new, narrowing(only_if_new, only_over))
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _record_many(
        self,
        states: Sequence[TaskState],
        only_if_new: bool,
        only_over: Collection[TaskStatus] | None,
    ) -> None:
        if only_if_new and not any(st.status.terminal for st in states) and not self._cluster:
            # The publish_many case: one script call for the whole batch, not one per task
            # (not on a cluster: the tasks' keys are in different slots).
            keys: list[str] = []
            # One TTL for the batch: the longest any of its records needs.
            args: list[Any] = [max(self._record_ttl_ms(st) for st in states)]
            args.append(4 if self.index.enabled else 2)  # ARGV per task
            for st in states:
                keys += self._record_keys(st)
                args += [st.status.value, st.model_dump_json(), *self.index.block(st)]
            await self._record_new_many(keys=keys, args=args)
            return
        # Queued together in this loop iteration: one pipeline (up to the batch bound).
        over = _only_over_arg(only_over)
        await asyncio.gather(
            *(self._pipe.script(self._record, *self._record_call(st, over)) for st in states)
        )

    async def forget_queued(self, queue: str, task_id: str) -> None:
        keys = [state_key(queue, task_id), latest_key(task_id)]
        try:
            forgot = await self._pipe.script(
                self._forget_queued, keys, self.index.forget_args(queue, task_id)
            )
            if forgot:
                await self.index.forget_beside(queue, task_id)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def keep_fingerprint(
        self, queue: str, task_id: str, fingerprint: str, ttl_s: float
    ) -> str:
        args = [fingerprint, max(1, int(ttl_s * 1000))]
        try:
            kept = await self._pipe.script(self._keep_fingerprint, [body_key(queue, task_id)], args)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return kept.decode() if isinstance(kept, bytes) else str(kept)

    async def get(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        try:
            if queue is None:
                raw = await self._pipe.script(self._get_latest, [latest_key(task_id)], [])
            else:
                raw = await self._pipe.hget(state_key(queue, task_id), "state")
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e
        return TaskState.model_validate_json(raw) if raw is not None else None

    async def wait(self, task_id: str, timeout_s: float, *, queue: str | None = None) -> TaskState:
        try:
            return await self._wait(task_id, timeout_s, queue)
        except REDIS_FAILURES as e:
            raise state_unavailable(e) from e

    async def _wait(self, task_id: str, timeout_s: float, queue: str | None) -> TaskState:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Watched before the first read, which waits for the subscription: a result stored
        # in between still wakes us. The channel is per task id; a wake-up for another
        # queue's record costs one re-read.
        wakeups = self._wakeups.here()
        watch = wakeups.watch(done_channel(task_id))
        try:
            while True:
                left = deadline - loop.time()
                # Unsubscribed (not yet, or the connection was lost): re-read on a beat.
                await watch.wait(left if watch.subscribed else min(left, _RECHECK_S))
                state = await self.get(task_id, queue=queue)
                if state is not None and state.status.terminal:
                    return state
                if deadline - loop.time() <= 0:
                    raise ResultTimeoutError(task_id, timeout_s, state)
        finally:
            wakeups.unwatch(watch)

"""The worker's record in the worker registry (``weclaw-mq inspect``; ``state.worker_registry``).

One task per worker writes it every ``worker_beat_s``, from what the worker keeps anyway: the
cancel watches of the deliveries it processes (task id, queue, attempt: ``worker.cancel_watch``)
and the deadline each handler runs under (when it started). A delivery's path pays nothing
for it: no call, no await, no Redis command. The record lists at most the worker's concurrency
(and ``LISTED_TASKS_MAX``) of its tasks, the longest-running first, and counts the rest. The
worker deletes it when it stops; one it cannot delete (Redis away), like a killed worker's,
lapses ``BEATS_KEPT`` beats after it was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from weclaw_mq.policy.failures import describe
from weclaw_mq.state.worker_registry import (
    BEATS_KEPT,
    LISTED_TASKS_MAX,
    RunningTask,
    WorkerRecord,
    WorkerRegistry,
)
from weclaw_mq.wire.connection import cancelled_by_caller
from weclaw_mq.worker.cancel_watch import Cancels, Watch

log = logging.getLogger("weclaw_mq.worker")


class Beat:
    """One worker's beat: its record, written until ``run`` is cancelled, deleted by ``leave``.

    Args:
        registry: Where the record goes.
        worker_id: The worker's id in the registry.
        app: The App's name.
        queues: The handler queues the worker consumes.
        concurrency: The worker's concurrency (also the most tasks a record lists).
        cancels: The worker's cancel watches: one per delivery it processes.
        state: The worker's state now ("consuming", "connecting", "stopping").
        interval_s: How often the record is written.
        leave_timeout_s: How long ``leave`` waits for Redis.
        breakers: The worker's breakers that are not closed (queue -> state), now.
        sync_threads: Its plain-def threads now: (size, held by calls past their timeout).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        worker_id: str,
        app: str,
        queues: Sequence[str],
        concurrency: int,
        cancels: Cancels,
        state: Callable[[], str],
        interval_s: float,
        leave_timeout_s: float,
        breakers: Callable[[], dict[str, str]] = dict,
        sync_threads: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self._registry = registry
        self._breakers = breakers
        self._sync_threads = sync_threads
        self.worker_id = worker_id
        self._app = app
        self._queues = tuple(queues)
        self._concurrency = concurrency
        self._cancels = cancels
        self._state = state
        self.interval_s = interval_s
        self.ttl_s = interval_s * BEATS_KEPT
        self._leave_timeout_s = leave_timeout_s
        # Read when the worker runs, not when it is made: a --processes child is forked.
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._started_at = datetime.now(UTC)
        self._started = time.monotonic()

    def record(self) -> WorkerRecord:
        """The worker as it is now."""
        now = time.monotonic()
        watched = self._cancels.watched()
        listed = _longest_running(watched, min(self._concurrency, LISTED_TASKS_MAX))
        tasks = tuple(
            RunningTask(w.task_id, w.queue, w.attempt, None if at is None else round(now - at, 3))
            for at, w in listed
        )
        threads, stuck = self._sync_threads()
        return WorkerRecord(
            worker_id=self.worker_id,
            app=self._app,
            host=self._host,
            pid=self._pid,
            started_at=self._started_at.isoformat(timespec="seconds"),
            uptime_s=round(now - self._started, 3),
            queues=self._queues,
            concurrency=self._concurrency,
            state=self._state(),
            in_flight=len(watched),
            tasks=tasks,
            more=len(watched) - len(tasks),
            beat_s=self.interval_s,
            ttl_s=self.ttl_s,
            breakers=self._breakers(),
            sync_threads=threads,
            sync_threads_stuck=stuck,
        )

    async def run(self, stopping: asyncio.Event) -> None:
        """Until cancelled: the record every ``interval_s``, and once more when ``stopping`` is
        set (it then says so). A failed write is logged once per outage and tried again."""
        failing = 0
        while True:
            try:
                await self._registry.beat(self.record(), self.ttl_s)
            except Exception as e:
                failing += 1
                log.log(
                    logging.WARNING if failing == 1 else logging.DEBUG,
                    "could not write this worker's record for 'weclaw-mq inspect' (%s); trying "
                    "again every %g s",
                    describe(e),
                    self.interval_s,
                )
            else:
                if failing:
                    log.info("wrote this worker's record for 'weclaw-mq inspect' again")
                failing = 0
            if stopping.is_set():
                await asyncio.sleep(self.interval_s)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.interval_s)

    async def leave(self) -> None:
        """Delete the record (the worker stopped), within ``leave_timeout_s``; if Redis does
        not answer, the record lapses by itself."""
        try:
            await asyncio.wait_for(self._registry.leave(self.worker_id), self._leave_timeout_s)
        except (Exception, asyncio.CancelledError) as e:
            why = describe(e)
            if isinstance(e, asyncio.CancelledError):
                if cancelled_by_caller():
                    raise
                # Not our task's: the app closed its Redis client under the stopping worker
                # (its pipe cancels what waits), which must not end the worker's run.
                why = "the app's Redis client closed"
            log.info(
                "could not delete this worker's record for 'weclaw-mq inspect' (%s); it "
                "lapses within %g s",
                why,
                self.ttl_s,
            )


def _longest_running(watched: list[Watch], cap: int) -> list[tuple[float | None, Watch]]:
    """Up to ``cap`` of ``watched`` with their handlers' start: the earliest first, then
    those whose handler has not started."""
    started = [(w.handler_started(), w) for w in watched]
    started.sort(key=lambda pair: (pair[0] is None, pair[0] or 0.0))
    return started[:cap]

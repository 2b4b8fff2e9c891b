"""The "queued" records a publish writes beside the broker's confirm, and the background
writes they leave behind: started, waited for briefly, taken back for refused tasks, and held
until they end (awaited, briefly, on close)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, cast

import aio_pika

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms
from weclaw_mq.contract.naming import session_id_or_none
from weclaw_mq.state import RecordsSoon, TaskState, TaskStatus, TaskStore

log = logging.getLogger("weclaw_mq.producer")

# How long publish waits, after the broker's confirm, for the task's "queued" record. Redis
# usually answers in well under a millisecond, so status() right after publish sees the
# record; a Redis that hangs costs a publish at most this, never its socket timeout: the
# write goes on in the background (and only_if_new keeps it from hiding a later status).
QUEUED_RECORD_WAIT_S = 0.25
# On close, how long pending "queued" writes may still take before they are dropped.
QUEUED_RECORD_CLOSE_WAIT_S = 1.0


def queued_state(message: aio_pika.Message, queue: str) -> TaskState:
    """The "queued" record of a task about to be published, with its deadline."""
    assert message.message_id is not None
    return TaskState(
        task_id=message.message_id,
        queue=queue,
        status=TaskStatus.QUEUED,
        expires_at=as_datetime(deadline_ms(message.headers)),
        session_id=session_id_or_none((message.headers or {}).get(h.SESSION_ID)),
    )


class QueuedRecords:
    """One App's best-effort state writes around its publishes."""

    def __init__(self) -> None:
        # Writes that outlived their publish: held here so they are not garbage-collected
        # mid-write, and awaited (briefly) on close.
        self._writes: set[asyncio.Future[Any]] = set()
        # The store the queued records are written to, and whether it is RecordsSoon.
        self._soon: tuple[TaskStore, bool] | None = None

    def write(self, store: TaskStore, state: TaskState) -> asyncio.Future[Any]:
        """The "queued" record's write, started: at once where the store can (``RecordsSoon``:
        it leaves before the publish's frame, with no task to schedule), else as a task."""
        soon = self._soon
        if soon is None or soon[0] is not store:  # decided once per store
            soon = self._soon = (store, isinstance(store, RecordsSoon))
        if not soon[1]:
            return self.in_background(store.record(state, only_if_new=True))
        write = asyncio.ensure_future(cast(RecordsSoon, store).record_soon(state, only_if_new=True))
        self._writes.add(write)
        write.add_done_callback(self._ended)
        return write

    def in_background(self, write: Coroutine[Any, Any, object]) -> asyncio.Task[Any]:
        """Run a best-effort state write as a task we hold until it ends (the loop itself
        keeps only a weak reference), and log its failure whoever waited for it."""
        task = asyncio.create_task(write)
        self._writes.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self._writes.discard(task)
        # The task is safe in the broker whatever happens here: a missing "queued" record only
        # means status() answers None until a worker picks the task up.
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning("could not record the queued status (%s: %s)", type(e).__name__, e)

    async def settle(
        self, queued: asyncio.Future[Any], store: TaskStore, queue: str, refused: list[str]
    ) -> None:
        """Wait for the "queued" write, then drop the records of ``refused`` tasks, both within
        ``QUEUED_RECORD_WAIT_S`` in all; what is left goes on in the background."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + QUEUED_RECORD_WAIT_S
        if not queued.done():
            # asyncio.wait never cancels what it waits for: a slow write goes on after we return.
            await asyncio.wait({queued}, timeout=QUEUED_RECORD_WAIT_S)
        if not refused:
            return
        forgetting = self.in_background(self._forget_after(queued, store, queue, refused))
        left = deadline - loop.time()
        if left > 0:
            await asyncio.wait({forgetting}, timeout=left)

    async def _forget_after(
        self, queued: asyncio.Future[Any], store: TaskStore, queue: str, refused: list[str]
    ) -> None:
        # Only once the write ended: a forget that overtook it would leave a "queued" record
        # for a task the broker does not hold.
        await asyncio.wait({queued})
        for task_id in refused:
            try:
                await store.forget_queued(queue, task_id)
            except Exception as e:  # a stale "queued" record expires with its TTL
                log.warning("could not drop the queued status of %s (%s)", task_id, e)

    async def close(self) -> None:
        """Give pending writes up to ``QUEUED_RECORD_CLOSE_WAIT_S``, then drop (and log) the
        rest; before the store closes: a healthy Redis finishes them in milliseconds."""
        if not self._writes:
            return
        _, late = await asyncio.wait(self._writes, timeout=QUEUED_RECORD_CLOSE_WAIT_S)
        for write in late:
            write.cancel()
        if late:
            log.warning("dropped %d queued-status write(s) Redis did not answer", len(late))
            await asyncio.wait(late)

"""What ``App`` does with a publish the broker did not confirm, when an outbox is configured.

Which failures go to the outbox (``TO_OUTBOX``): no broker answered (``BrokerUnavailableError``:
refused, unreachable, no channel in time) and an unknown outcome (``ConfirmTimeoutError``,
``ConnectionLostError``: the message may be in its queue too; the relay sends it again with
the same task id and the idempotency guard absorbs the copy). Everything else still raises:
a nack (``PublishNackedError``: the broker is up and said no, e.g. a full queue with
reject-publish; storing it locally would only move the overflow to the producer's disk), an
unroutable queue, a payload error.

The outbox is opened on first use (or ``App.start_outbox()``): a corrupt or unwritable file
fails there, with ``OutboxUnusableError``, never silently falling back to raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

from aio_pika.message import Message

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms
from weclaw_mq.contract.naming import session_id_or_none
from weclaw_mq.errors import (
    BatchPublishError,
    BrokerUnavailableError,
    ConfirmTimeoutError,
    ConnectionLostError,
    StateUnavailableError,
)
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.outbox.relay import Relay
from weclaw_mq.outbox.store import Outbox, row_headers
from weclaw_mq.settings import Settings
from weclaw_mq.state import TaskState, TaskStatus, TaskStore
from weclaw_mq.state.expiry import as_seen_at

log = logging.getLogger("weclaw_mq.outbox")

TO_OUTBOX = (BrokerUnavailableError, ConfirmTimeoutError, ConnectionLostError)
# How long close() gives the in-app relay to end its pass (a window waits at most
# confirm_timeout_s for its confirms) before it is cancelled; its claims then lapse.
RELAY_STOP_EXTRA_S = 5.0
# How long a publish that went to the outbox waits for its status write (as long as a
# confirmed publish waits for its "queued" record); a slow write goes on in the background.
STATUS_WAIT_S = 0.25

Send = Callable[[str, Message], Awaitable[str]]
SendMany = Callable[[str, list[Message]], Awaitable[list[str]]]
Background = Callable[[Coroutine[Any, Any, object]], "asyncio.Task[Any]"]


class LocalFallback:
    """The App's outbox and in-process relay."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        results: Callable[[], TaskStore | None],
        background: Background,
        name: str,
        queue_type_of: Callable[[str], str] | None = None,
        fair_of: Callable[[str], bool] | None = None,
        unavailable: Callable[[], BrokerUnavailableError | None] = lambda: None,
        reached: Callable[[], None] = lambda: None,
    ) -> None:
        assert settings.outbox_path is not None
        self.settings = settings
        self.path = settings.outbox_path
        self._metrics = metrics
        self._results = results
        self._background = background
        self._name = name
        self._queue_type_of = queue_type_of
        self._fair_of = fair_of
        self._outbox: Outbox | None = None
        self._opening = asyncio.Lock()
        self.relay: Relay | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._stored_since_confirm = False
        # The producer's word that the broker is down and no connect is due yet
        # (Publisher.unavailable): a publish then goes straight to the outbox.
        self._unavailable = unavailable
        self._reached = reached  # the relay connected: Publisher.broker_reached
        self._outage_stored = 0  # tasks stored since the broker last answered (its outage)

    async def open(self) -> Outbox:
        """The outbox, opened (and its relay started) on the first call."""
        if self._outbox is not None:
            return self._outbox
        async with self._opening:
            if self._outbox is None:
                s = self.settings
                outbox = await Outbox.open(
                    self.path, max_rows=s.outbox_max_rows, max_bytes=s.outbox_max_bytes
                )
                if s.outbox_relay_in_app:
                    self.relay = Relay(
                        outbox,
                        s,
                        self._metrics,
                        store=self._results(),
                        name=f"{self._name}-relay",
                        queue_type_of=self._queue_type_of,
                        fair_of=self._fair_of,
                        reached=self._reached,
                    )
                    self._stop = asyncio.Event()
                    self._relay_task = asyncio.create_task(self.relay.run(self._stop))
                self._outbox = outbox
        return self._outbox

    async def publish(self, queue: str, message: Message, send: Send) -> str:
        outbox = await self.open()
        down = self._unavailable()
        if down is not None:  # no connect, no "queued" record to write and take back
            await self._store(outbox, queue, [message], down)
            return message.message_id or ""
        try:
            task_id = await send(queue, message)
        except TO_OUTBOX as e:
            await self._store(outbox, queue, [message], e)
            return message.message_id or ""
        self._broker_answers()
        return task_id

    def _broker_answers(self) -> None:
        """A publish was confirmed: if this process stored tasks during an outage, the relay
        (which backs off while the broker is away) starts sending them now."""
        if self._outage_stored:
            log.info(
                "RabbitMQ answers again: %d task(s) were stored in the outbox %s while it did "
                "not; the relay sends them",
                self._outage_stored,
                self.path,
            )
            self._outage_stored = 0
        if self._stored_since_confirm and self.relay is not None:
            self._stored_since_confirm = False
            self.relay.wake()

    async def publish_many(self, queue: str, messages: list[Message], send: SendMany) -> list[str]:
        outbox = await self.open()
        down = self._unavailable()
        if down is not None:
            await self._store(outbox, queue, messages, down)
            return [m.message_id or "" for m in messages]
        try:
            task_ids = await send(queue, messages)
        except BrokerUnavailableError as e:  # the connect before the batch: nothing was sent
            await self._store(outbox, queue, messages, e)
            return [m.message_id or "" for m in messages]
        except BatchPublishError as e:
            local = sorted(i for i, err in e.failed.items() if isinstance(err, TO_OUTBOX))
            if local:
                await self._store(outbox, queue, [messages[i] for i in local], e.failed[local[0]])
            refused = {i: err for i, err in e.failed.items() if i not in set(local)}
            if refused:
                # Only what the broker refused outright is the caller's to handle now.
                raise BatchPublishError(queue, e.task_ids, refused) from e
            return e.task_ids
        self._broker_answers()
        return task_ids

    async def _store(
        self, outbox: Outbox, queue: str, messages: Sequence[Message], cause: Exception
    ) -> None:
        """All of ``messages`` in one transaction (or ``OutboxFullError``/``...Unusable``,
        raised from ``cause``), then their ``stored_locally`` status, best effort."""
        try:
            await outbox.add([(queue, m) for m in messages])
        except Exception as e:
            raise e from cause
        outage = isinstance(cause, BrokerUnavailableError)
        # An outage is said once, at its first task (the count comes when it ends); an
        # unknown outcome (a timeout, a lost link) is rare and said each time.
        if not outage or not self._outage_stored:
            log.warning(
                "stored %d task(s) for %r in the outbox %s (%s: %s)%s",
                len(messages),
                queue,
                self.path,
                type(cause).__name__,
                cause,
                "; so are the next while RabbitMQ does not answer" if outage else "",
            )
        if outage:
            self._outage_stored += len(messages)
        self._metrics.outbox_stored.labels(queue).inc(len(messages))
        self._stored_since_confirm = True
        store = self._results()
        if store is not None:
            # For an unknown outcome it replaces the "queued" record written beside the
            # publish, never what a worker wrote meanwhile (state.transitions). With the
            # deadline: past it, the task reads expired while it still sits here.
            write = self._background(
                store.record_many(
                    [
                        TaskState(
                            task_id=m.message_id or "",
                            queue=queue,
                            status=TaskStatus.STORED_LOCALLY,
                            reason=type(cause).__name__,
                            expires_at=as_datetime(deadline_ms(m.headers)),
                            session_id=session_id_or_none((m.headers or {}).get(h.SESSION_ID)),
                        )
                        for m in messages
                    ]
                )
            )
            await asyncio.wait({write}, timeout=STATUS_WAIT_S)

    async def status(
        self,
        task_id: str,
        queue: str | None,
        stored: Callable[[], Awaitable[TaskState | None]],
    ) -> TaskState | None:
        """The store's record; when it has none, or does not answer, the outbox's word: a
        task still in the outbox is ``stored_locally`` (``expired`` past its deadline)."""
        try:
            state = await stored()
        except StateUnavailableError:
            if (local := await self._find(task_id, queue)) is None:
                raise
            return local
        return state if state is not None else await self._find(task_id, queue)

    async def holds(self, task_id: str) -> bool:
        return await (await self.open()).find(task_id) is not None

    async def _find(self, task_id: str, queue: str | None) -> TaskState | None:
        outbox = await self.open()
        row = await outbox.find_row(task_id)
        if row is None or (queue is not None and row.queue != queue):
            return None
        local = TaskState(
            task_id=task_id,
            queue=row.queue,
            status=TaskStatus.STORED_LOCALLY,
            expires_at=as_datetime(deadline_ms(row_headers(row))),
        )
        return as_seen_at(local, datetime.now(UTC))

    async def close(self) -> None:
        if self._outage_stored:
            log.warning(
                "%d task(s) were stored in the outbox %s while RabbitMQ did not answer; "
                "the relay sends them once it does",
                self._outage_stored,
                self.path,
            )
            self._outage_stored = 0
        task, self._relay_task = self._relay_task, None
        if task is not None:
            self._stop.set()
            done, _ = await asyncio.wait(
                {task}, timeout=self.settings.confirm_timeout_s + RELAY_STOP_EXTRA_S
            )
            if not done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            elif not task.cancelled() and (e := task.exception()) is not None:
                log.warning("the outbox relay ended with %s: %s", type(e).__name__, e)
        outbox, self._outbox = self._outbox, None
        if outbox is not None:
            await outbox.close()

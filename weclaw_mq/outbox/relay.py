"""The relay: sends the outbox's rows to the broker, oldest first, and deletes each row only
after the broker confirmed it.

One pass claims a window of rows (``outbox_relay_window``), publishes them all on one
confirming channel, awaits their confirms together (within ``confirm_timeout_s``), then
deletes the confirmed rows in one transaction; rows that failed (no connection, nacked,
unroutable, no confirm in time) are given back with their error and tried again after
``outbox_relay_interval_s``. A window in flight keeps the broker busy the way
``publish_many`` does, so draining runs near its rate rather than one round trip per row.

The bytes sent are the row's: body and properties as publish built them, through aiormq's
``basic_publish``. A row holds the handler queue Q: publish could not always ask the broker's
version before the outage, so the relay routes a task above NORMAL to its priority's lane (or
sets the AMQP priority on a native plan) as publish would have (``priority.route``).

After a confirm, the task's status moves from ``stored_locally`` to ``queued``, with its
deadline (``status()`` reads it ``expired`` past it). Written after the confirm, so a worker
may have written its own status first: the write is made only over ``stored_locally`` or no
record (``state.transitions``), and never hides what a worker wrote.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from pamqp.commands import Basic

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import as_datetime, deadline_ms
from weclaw_mq.contract.naming import session_id_or_none
from weclaw_mq.errors import BrokerUnavailableError
from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.outbox.store import OutboxRow, RelayStore, row_headers
from weclaw_mq.policy.broker_version import ServerVersion
from weclaw_mq.policy.priority import QUORUM, priority_from_header, route
from weclaw_mq.settings import Settings
from weclaw_mq.state import TaskState, TaskStatus, TaskStore
from weclaw_mq.wire.connection import (
    LINK_ERRORS,
    BrokerEndpoints,
    backoff_s,
    cancelled_by_caller,
    channel_server_version,
    is_alive,
)

log = logging.getLogger("weclaw_mq.outbox")

# The records the relay's "queued" may replace (besides none): a worker's, written once the
# broker delivered the row, is newer than the confirm.
FROM_THE_OUTBOX = frozenset({TaskStatus.STORED_LOCALLY})
# How long the relay waits for the "queued" status writes of a window before moving on; the
# status is best effort (the task is on the broker either way).
STATUS_WAIT_S = 1.0
# Windows out at once (see Relay.drain): two keep the pipe full without holding more rows
# claimed than needed.
WINDOWS_IN_FLIGHT = 2


class Relay:
    def __init__(
        self,
        outbox: RelayStore,
        settings: Settings,
        metrics: Metrics,
        *,
        store: TaskStore | None = None,
        name: str = "weclaw-mq-outbox-relay",
        queue_type_of: Callable[[str], str] | None = None,
        fair_of: Callable[[str], bool] | None = None,
        reached: Callable[[], None] = lambda: None,
    ) -> None:
        self.outbox = outbox
        # Called when this relay connects: the App's publisher, backing off since its own
        # connect failed, tries at its next publish instead of storing it too.
        self._reached = reached
        # A standalone relay knows no handler: it takes Q for a default (quorum) handler
        # queue, as a producer-only App does.
        self.queue_type_of = queue_type_of or (lambda queue: QUORUM)
        # Whether a handler has fair share (its priorities then take lanes on every broker);
        # its NORMAL tasks go to Q: the relay does not place tenants (policy.fair_share).
        self.fair_of = fair_of or (lambda queue: False)
        self.settings = settings
        self.metrics = metrics
        self.store = store
        self.name = name
        self.sent = 0  # rows confirmed and deleted by this relay
        self._broker = BrokerEndpoints(settings)
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Look at the outbox now rather than at the next interval."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Drain, then wait for more, until ``stop`` is set. A failed pass is logged and
        retried after ``outbox_relay_interval_s``, backing off (up to
        ``reconnect_max_delay_s``) while the broker stays away; nothing but ``stop`` ends the
        loop: a relay that died quietly would leave the outbox to grow."""
        interval = self.settings.outbox_relay_interval_s
        failures = 0
        try:
            while not stop.is_set():
                # Cleared before the pass, not after: a wake while it runs (a row committed
                # after its last claim) must start the next pass, not wait for the interval.
                self._wake.clear()
                try:
                    await self.drain()
                    failures = 0
                except asyncio.CancelledError:
                    if cancelled_by_caller():
                        raise
                    failures += 1  # aiormq's own cancel: the link died
                    await self._drop_link()
                except (BrokerUnavailableError, *LINK_ERRORS, TimeoutError) as e:
                    failures += 1
                    # Once per outage: the passes that follow say the same thing.
                    log.log(
                        logging.WARNING if failures == 1 else logging.DEBUG,
                        "outbox relay: broker not reachable (%s); trying again, backing off "
                        "up to %g s",
                        e,
                        self.settings.reconnect_max_delay_s,
                    )
                    await self._drop_link()
                except Exception as e:  # the file (disk full, locked too long) or ours
                    failures += 1
                    log.error("outbox relay: pass failed (%s: %s)", type(e).__name__, e)
                    await self._drop_link()
                await self._update_gauges()
                delay = interval
                if failures:
                    delay = max(interval, backoff_s(failures, self.settings.reconnect_max_delay_s))
                    self._wake.clear()  # a failing broker is backed off from, woken or not
                waits = {
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(self._wake.wait()),
                }
                try:
                    await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            await self.close()

    async def drain(self) -> int:
        """Send every row that is not claimed by another relay; how many were confirmed.

        Up to ``WINDOWS_IN_FLIGHT`` windows are out at once: the next window's frames go out
        while the broker still confirms the last, as ``publish_many`` keeps its pipe full.
        Frames leave in claim order on one channel, so rows still reach the queue oldest
        first. Stops claiming at the first window with a failure (the broker is in trouble:
        come back later)."""
        window = self.settings.outbox_relay_window
        in_flight: set[asyncio.Task[tuple[int, bool]]] = set()
        total = 0
        failing = False
        try:
            while not failing:
                rows = await self.outbox.claim(window, self.settings.outbox_claim_s)
                if not rows:
                    break
                try:
                    channel = await self._ready_channel()
                except BaseException:
                    await self.outbox.release([(r.seq, "broker unavailable") for r in rows], 0.0)
                    raise
                in_flight.add(asyncio.create_task(self._window(channel, rows)))
                if len(in_flight) >= WINDOWS_IN_FLIGHT:
                    done, in_flight = await asyncio.wait(
                        in_flight, return_when=asyncio.FIRST_COMPLETED
                    )
                    for task in done:
                        sent, failed = task.result()
                        total += sent
                        failing = failing or failed
            for window_out in asyncio.as_completed(in_flight):
                sent, _ = await window_out
                total += sent
            in_flight = set()
        finally:
            if in_flight:  # an error or a cancel: let the windows out settle their rows
                await asyncio.wait(in_flight)
        return total

    async def _window(
        self, channel: AbstractChannel, rows: Sequence[OutboxRow]
    ) -> tuple[int, bool]:
        """Send ``rows``, await their confirms, delete the confirmed ones, give back the rest:
        (confirmed, whether any failed)."""
        try:
            confirmed, failed = await self._send_window(channel, rows)
        except BaseException:
            # Back at once (none or some of them may be on the broker: sent again, the
            # copies are absorbed by the guard), not after the claim's lease.
            await self.outbox.release([(r.seq, "the relay's link failed") for r in rows], 0.0)
            raise
        await self.outbox.delete([r.seq for r in confirmed])
        if failed:
            await self.outbox.release(
                [(r.seq, why) for r, why in failed], self.settings.outbox_relay_interval_s
            )
            log.warning(
                "outbox relay: %d of %d rows not confirmed (first: %s); kept for the next pass",
                len(failed),
                len(rows),
                failed[0][1],
            )
        self.sent += len(confirmed)
        for row in confirmed:
            self.metrics.outbox_relayed.labels(row.queue).inc()
        await self._mark_queued(confirmed)
        return len(confirmed), bool(failed)

    async def _ready_channel(self) -> AbstractChannel:
        channel, conn = self._channel, self._connection
        if channel is not None and not channel.is_closed and conn is not None and is_alive(conn):
            return channel
        await self._drop_link()
        self._connection = await self._broker.connect(name=self.name)
        # on_return_raises: an unroutable row must fail, not be dropped silently.
        self._channel = await self._connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        self._reached()
        return self._channel

    async def _send_window(
        self, channel: AbstractChannel, rows: Sequence[OutboxRow]
    ) -> tuple[list[OutboxRow], list[tuple[OutboxRow, str]]]:
        underlay = await channel.get_underlay_channel()
        version = await channel_server_version(channel)
        sends = []
        for row in rows:
            properties = row.amqp_properties()
            target = self._route(row, properties, version)
            sends.append(
                asyncio.ensure_future(
                    underlay.basic_publish(
                        row.body, routing_key=target, properties=properties, mandatory=True
                    )
                )
            )
        # One deadline for the window: a blocked broker (memory alarm) must not hold the rows
        # claimed forever; what is not confirmed by then is sent again later.
        _, pending = await asyncio.wait(sends, timeout=self.settings.confirm_timeout_s)
        for send in pending:
            send.cancel()
        if pending:
            await asyncio.wait(pending)
        confirmed: list[OutboxRow] = []
        failed: list[tuple[OutboxRow, str]] = []
        lost_link = False
        for row, send in zip(rows, sends, strict=True):
            if send.cancelled():
                failed.append((row, f"no confirm within {self.settings.confirm_timeout_s} s"))
                continue
            error = send.exception()
            if error is None:
                confirmed.append(row)
                continue
            if isinstance(error, aiormq.exceptions.PublishError):
                why = f"unroutable: no queue named {row.queue!r}"
            elif isinstance(error, aiormq.exceptions.DeliveryError):
                why = "nacked by the broker (queue full?)"
            else:
                lost_link = lost_link or isinstance(error, LINK_ERRORS)
                why = f"{type(error).__name__}: {error}"
            failed.append((row, why))
        if pending or lost_link:
            await self._drop_link()  # a fresh channel next pass, never a half-broken one
        return confirmed, failed

    def _route(
        self, row: OutboxRow, properties: Basic.Properties, version: ServerVersion | None
    ) -> str:
        """The row's lane (Q for NORMAL), and on a native plan its AMQP priority."""
        headers = properties.headers if isinstance(properties.headers, dict) else {}
        level = priority_from_header(headers.get(h.PRIORITY))
        target, amqp_priority = route(
            row.queue,
            level,
            version,
            self.queue_type_of(row.queue),
            fair=self.fair_of(row.queue),
        )
        if amqp_priority is not None:
            properties.priority = amqp_priority
        return target

    async def _mark_queued(self, rows: Sequence[OutboxRow]) -> None:
        if self.store is None or not rows:
            return
        write = asyncio.ensure_future(
            self.store.record_many(
                [
                    TaskState(
                        task_id=r.task_id,
                        queue=r.queue,
                        status=TaskStatus.QUEUED,
                        expires_at=as_datetime(deadline_ms(row_headers(r))),
                        session_id=session_id_or_none(row_headers(r).get(h.SESSION_ID)),
                    )
                    for r in rows
                ],
                only_over=FROM_THE_OUTBOX,
            )
        )
        done, _ = await asyncio.wait({write}, timeout=STATUS_WAIT_S)
        if write in done and write.exception() is not None:
            log.warning("outbox relay: could not record the queued status (%s)", write.exception())
        elif write not in done:
            write.cancel()

    async def _update_gauges(self) -> None:
        try:
            stats = await self.outbox.stats()
        except Exception as e:  # the next pass tries again; the relay itself goes on
            log.warning("outbox relay: cannot read the outbox's size (%s)", e)
            return
        self.metrics.outbox_rows.set(stats.rows)
        self.metrics.outbox_oldest_age.set(stats.oldest_age_s or 0.0)

    async def _drop_link(self) -> None:
        conn, self._connection, self._channel = self._connection, None, None
        if conn is not None and not conn.is_closed:
            try:
                await asyncio.wait_for(conn.close(), 5.0)
            except Exception as e:
                log.debug("closing the relay's connection failed: %s", e)

    async def close(self) -> None:
        await self._drop_link()

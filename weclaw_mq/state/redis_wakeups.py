"""One pub/sub connection per store (per event loop) for every waiter in the process.

``result()`` waiters (a task's done channel) and stream readers (a stream's or an inbox's
channel) each used to hold a pooled connection of their own, with its own subscription, for
their whole wait: a few thousand waiters drained the pool, and ``publish`` and ``status()``
failed with them. Here one task owns one ``PubSub`` and subscribes every watched channel on
it (batched: what is watched in one loop iteration leaves as one ``SUBSCRIBE``); a message
wakes that channel's watchers, who re-read what they wait for through the store's shared
(auto-pipelined) connections. On a Redis Cluster one connection suffices too: a classic
``PUBLISH`` reaches the subscribers of every node.

A watcher never misses a write that follows its watch: it is woken when its channel's
subscription is confirmed (or at once if it already is), and its first read follows that. A
lost connection wakes every watcher (each re-reads, and finds Redis failing itself if it is
down); until the channels are subscribed again watchers re-read every ``RECHECK_S``, as they
would without a notification. A channel stays subscribed ``_LINGER_S`` after its last
watcher left, so a reader that reads again at once (a stream's next batch) costs no
``SUBSCRIBE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from weclaw_mq.state.redis_clients import StateClient

log = logging.getLogger("weclaw_mq.state")

# Waiters re-read what they wait for this often while their subscription is not in place
# (being made, or lost with its connection), so a notification missed then costs at most this.
RECHECK_S = 2.0
# A read of the pub/sub connection is bounded (redis-py applies the pool's socket timeout
# to a blocking read); idle channels are dropped on this beat too.
_POLL_S = 1.0
# How long a channel stays subscribed once nobody watches it.
_LINGER_S = 2.0
# The longest pause before subscribing again after the connection failed.
_MAX_BACKOFF_S = 2.0


class Watch:
    """One waiter's interest in one channel (``Wakeups.watch``); ``wait`` until woken."""

    __slots__ = ("_channel", "_future", "_woken")

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._woken = False
        self._future: asyncio.Future[None] | None = None

    def wake(self) -> None:
        self._woken = True
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    @property
    def subscribed(self) -> bool:
        """Whether a write now would wake this watch (its channel's subscription is live)."""
        return self._channel.confirmed

    async def wait(self, timeout_s: float) -> None:
        """Until woken since the last wait (a message, the subscription confirmed, the
        connection lost or regained), or ``timeout_s`` passed."""
        if not self._woken and timeout_s > 0:
            loop = asyncio.get_running_loop()
            future = self._future = loop.create_future()
            timer = loop.call_later(timeout_s, _resolve, future)
            try:
                await future
            finally:
                timer.cancel()
                self._future = None
        self._woken = False


def _retrieve(task: asyncio.Task[None]) -> None:
    # A failed send is the reader's to handle (the connection is closed by then).
    if not task.cancelled():
        task.exception()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Channel:
    __slots__ = ("confirmed", "idle_since", "watches")

    def __init__(self) -> None:
        self.watches: set[Watch] = set()
        self.confirmed = False  # subscribed on the current connection
        self.idle_since: float | None = None  # loop time its last watcher left


class LoopWakeups:
    """A store's one ``Wakeups``, on the running event loop: made when first asked for, and
    made again on a new loop (the old one died with its loop).

    Args:
        client: The store's redis-py client.
    """

    def __init__(self, client: StateClient) -> None:
        self._client = client
        self._wakeups: Wakeups | None = None

    def here(self) -> Wakeups:
        """The subscription on the running loop, shared by every waiter of the store.

        Returns:
            The ``Wakeups``.
        """
        wakeups = self._wakeups
        if wakeups is None or wakeups.loop is not asyncio.get_running_loop():
            wakeups = self._wakeups = Wakeups(self._client)
        return wakeups

    async def close(self) -> None:
        """Close the subscription if it is the running loop's (another loop's died with it)."""
        wakeups, self._wakeups = self._wakeups, None
        if wakeups is not None and wakeups.loop is asyncio.get_running_loop():
            await wakeups.close()


class Wakeups:
    """The watched channels of one store on one event loop, and the one connection that
    hears them. ``watch``/``unwatch`` are synchronous and cheap; the connection is opened on
    the first watch and closed once nothing is watched (after the linger)."""

    def __init__(self, client: StateClient) -> None:
        self._client = client
        self.loop = asyncio.get_running_loop()
        self._channels: dict[str, _Channel] = {}
        self._to_subscribe: set[str] = set()
        self._to_unsubscribe: set[str] = set()
        self._pubsub: Any = None  # the live PubSub, once its first SUBSCRIBE went out
        self._runner: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None

    @property
    def channels(self) -> int:
        """How many channels are subscribed or about to be (for tests and benchmarks)."""
        return len(self._channels)

    def watch(self, channel: str) -> Watch:
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel()
            self._to_subscribe.add(channel)
            self._send_soon()
        entry.idle_since = None
        watch = Watch(entry)
        entry.watches.add(watch)
        if entry.confirmed:
            watch.wake()  # subscribed already: its first read may go at once
        runner = self._runner
        if runner is None or runner.done():
            self._runner = self.loop.create_task(self._run())
        return watch

    def unwatch(self, watch: Watch) -> None:
        entry = watch._channel
        entry.watches.discard(watch)
        if not entry.watches:
            entry.idle_since = self.loop.time()

    def _send_soon(self) -> None:
        if self._pubsub is not None and (self._sender is None or self._sender.done()):
            # On the next iteration: everything watched in this one leaves together.
            self._sender = self.loop.create_task(self._send(self._pubsub))
            self._sender.add_done_callback(_retrieve)

    async def _send(self, pubsub: Any) -> None:
        try:
            while self._to_subscribe or self._to_unsubscribe:
                # Unsubscribes first: a channel dropped and watched again must end subscribed.
                gone, self._to_unsubscribe = self._to_unsubscribe, set()
                new, self._to_subscribe = self._to_subscribe, set()
                if gone:
                    await pubsub.unsubscribe(*gone)
                if new:
                    await pubsub.subscribe(*new)
        except Exception:
            # The reader then fails on the dropped connection and subscribes everything again.
            with contextlib.suppress(Exception):
                await pubsub.aclose()
            raise

    async def _run(self) -> None:
        failures = 0
        while self._channels:
            pubsub: Any = self._client.pubsub()
            try:
                self._to_unsubscribe.clear()
                self._to_subscribe = set(self._channels)
                await self._send(pubsub)
                self._pubsub = pubsub
                self._send_soon()  # what was watched while the first SUBSCRIBE was out
                if failures:
                    log.info("listening for results and stream writes again")
                    failures = 0
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis failing: every watcher re-reads, then polls
                failures += 1
                self._lost()
                delay_s = min(0.05 * 2**failures, _MAX_BACKOFF_S)
                if failures == 1:
                    log.warning(
                        "lost the subscription for results and stream writes (%s: %s); "
                        "waiters poll until it is back",
                        type(e).__name__,
                        e,
                    )
                await asyncio.sleep(delay_s)
            finally:
                self._pubsub = None
                sender, self._sender = self._sender, None
                if sender is not None and not sender.done():
                    sender.cancel()
                for entry in self._channels.values():
                    entry.confirmed = False
                # aclose alone returns the connection to the pool (see RedisTaskStore).
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _listen(self, pubsub: Any) -> None:
        """Dispatch until nothing is watched any more; raise when the connection fails."""
        loop = self.loop
        next_sweep = loop.time() + _POLL_S
        while self._channels:
            sender = self._sender
            if (
                sender is not None
                and sender.done()
                and not sender.cancelled()
                and (error := sender.exception()) is not None
            ):
                raise error
            message = await pubsub.get_message(timeout=_POLL_S)
            if message is not None:
                self._dispatch(message)
            if loop.time() >= next_sweep:
                next_sweep = loop.time() + _POLL_S
                self._sweep(loop.time() - _LINGER_S)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind != "message" and kind != "subscribe":
            return
        channel = message.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        entry = self._channels.get(channel)  # type: ignore[arg-type]
        if entry is None:
            return
        if kind == "subscribe":
            entry.confirmed = True
        for watch in entry.watches:
            watch.wake()

    def _sweep(self, idle_before: float) -> None:
        gone = [
            name
            for name, entry in self._channels.items()
            if entry.idle_since is not None and entry.idle_since <= idle_before
        ]
        for name in gone:
            del self._channels[name]
            self._to_subscribe.discard(name)
            self._to_unsubscribe.add(name)
        if gone:
            self._send_soon()

    def _lost(self) -> None:
        for entry in self._channels.values():
            entry.confirmed = False
            for watch in entry.watches:
                watch.wake()

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        self._lost()  # whoever still waits re-reads, and finds the store closed
        self._channels.clear()
        if runner is not None and not runner.done():
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner

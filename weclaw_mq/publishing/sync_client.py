"""``app.sync``: the App's publishing and results API for code without an event loop.

A Django view, a Flask route, a management command or a notebook calls ``app.sync.publish``
and waits in its own thread; the work runs on one background event loop per process (a
daemon thread, started at the first call), so every thread shares the App's one broker
connection and Redis pool, and gets exactly what the async API returns or raises.

Forks: a child process does not inherit the loop's thread, and must not use the parent's
sockets. After ``fork`` (gunicorn's workers, Django's autoreloader, multiprocessing) the child
starts a loop of its own at its first call, and each App used through ``sync`` drops the
parent's connections (``App._after_fork``) and opens its own.

An App used through ``sync`` belongs to that loop: do not also ``await`` it on another loop
(an async view should ``await app.publish`` on an App of its own).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from aio_pika.abc import HeadersType

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.priority import Priority
from weclaw_mq.state import Cancellation, TaskState
from weclaw_mq.streaming import StreamEvent

_T = TypeVar("_T")

# How long the exit hook lets the Apps close (pending "queued" writes, the connection).
CLOSE_AT_EXIT_S = 5.0


class AsyncApp(Protocol):
    """What the sync client calls: the App's async API (``weclaw_mq.app.App``)."""

    # Properties, so the App's methods with their keyword-only options match.
    @property
    def publish(self) -> Callable[..., Coroutine[Any, Any, str]]: ...

    @property
    def publish_many(self) -> Callable[..., Coroutine[Any, Any, list[str]]]: ...

    @property
    def status(self) -> Callable[..., Coroutine[Any, Any, TaskState | None]]: ...

    @property
    def result(self) -> Callable[..., Coroutine[Any, Any, TaskState]]: ...

    @property
    def cancel(self) -> Callable[..., Coroutine[Any, Any, Cancellation]]: ...

    @property
    def stream(self) -> Callable[..., AsyncIterator[StreamEvent]]: ...

    async def close(self) -> None: ...

    def _after_fork(self) -> None: ...


class _BackgroundLoop:
    """One event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="weclaw-mq-sync-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            # A KeyboardInterrupt in the caller's thread (or the timeout) ends the work too.
            future.cancel()
            raise


# The process's loop, made at the first call; the pid tells a forked child it is not its own.
_lock = threading.Lock()
_loop: _BackgroundLoop | None = None
_loop_pid = 0
_clients: weakref.WeakSet[SyncClient] = weakref.WeakSet()
_hooks_registered = False


def _background() -> _BackgroundLoop:
    global _loop, _loop_pid, _hooks_registered
    with _lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop, _loop_pid = _BackgroundLoop(), os.getpid()
        if not _hooks_registered:
            # Registered at first use, not at import: importing weclaw_mq changes nothing.
            os.register_at_fork(after_in_child=_after_fork_in_child)
            atexit.register(_close_at_exit)
            _hooks_registered = True
        return _loop


def _after_fork_in_child() -> None:
    global _lock, _loop
    # Another thread may have held the lock at the fork: the child's copy would never open.
    _lock = threading.Lock()
    _loop = None
    for client in list(_clients):
        client._forked()


def _close_at_exit() -> None:
    loop = _loop
    if loop is None or _loop_pid != os.getpid() or not loop.thread.is_alive():
        return
    apps = [client.app for client in list(_clients) if client.used]

    async def close_all() -> None:
        await asyncio.gather(*(app.close() for app in apps), return_exceptions=True)

    # Exiting: what did not close in time is dropped.
    with contextlib.suppress(Exception):
        loop.run(close_all(), CLOSE_AT_EXIT_S)
    loop.loop.call_soon_threadsafe(loop.loop.stop)


class SyncClient:
    """The App's API as blocking calls, safe from any thread (``App.sync``).

    Each method runs its async namesake on the process's background loop and returns or
    raises exactly what that returns or raises.
    """

    def __init__(self, app: AsyncApp) -> None:
        self.app = app
        self.used = False
        _clients.add(self)

    def _run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise ConfigurationError(
                "app.sync blocks its thread, and this thread runs an event loop: in async "
                "code, await the App's own methods (await app.publish(...))"
            )
        loop = _background()
        if threading.current_thread() is loop.thread:  # pragma: no cover - a misuse guard
            coro.close()
            raise ConfigurationError("app.sync called from its own loop: await the App instead")
        self.used = True
        return loop.run(coro, timeout_s)

    def _forked(self) -> None:
        self.used = False
        self.app._after_fork()

    def publish(
        self,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        ttl_s: float | None = None,
        session_id: str | None = None,
        priority: Priority | str | None = None,
        delay_s: float | None = None,
        refuse_other_body: bool = False,
    ) -> str:
        """``App.publish``: the task id once the broker confirmed the task.

        Args:
            queue: The handler queue.
            payload: The task.
            task_id: As ``App.publish``.
            trace_id: As ``App.publish``.
            headers: As ``App.publish``.
            ttl_s: As ``App.publish``.
            session_id: As ``App.publish``.
            priority: As ``App.publish``.
            delay_s: As ``App.publish``.
            refuse_other_body: As ``App.publish``.

        Returns:
            The task id.

        Raises:
            ConfigurationError: Called from a thread that runs an event loop; or as
                ``App.publish``.
            PublishFailedError: As ``App.publish`` (and every other error it raises).
        """
        return self._run(
            self.app.publish(
                queue,
                payload,
                task_id=task_id,
                trace_id=trace_id,
                headers=headers,
                ttl_s=ttl_s,
                session_id=session_id,
                priority=priority,
                delay_s=delay_s,
                refuse_other_body=refuse_other_body,
            )
        )

    def publish_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        task_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        ttl_s: float | None = None,
        session_id: str | None = None,
        priority: Priority | str | None = None,
        delay_s: float | None = None,
    ) -> list[str]:
        """``App.publish_many``: a batch over one channel with pipelined confirms.

        Args:
            queue: The handler queue.
            payloads: The tasks.
            task_ids: As ``App.publish_many``.
            trace_id: As ``App.publish_many``.
            headers: As ``App.publish_many``.
            ttl_s: As ``App.publish_many``.
            session_id: As ``App.publish_many``.
            priority: As ``App.publish_many``.
            delay_s: As ``App.publish_many``.

        Returns:
            The task ids, in order.

        Raises:
            BatchPublishError: As ``App.publish_many`` (and every other error it raises).
        """
        return self._run(
            self.app.publish_many(
                queue,
                list(payloads),
                task_ids=task_ids,
                trace_id=trace_id,
                headers=headers,
                ttl_s=ttl_s,
                session_id=session_id,
                priority=priority,
                delay_s=delay_s,
            )
        )

    def status(self, task_id: str, *, queue: str | None = None) -> TaskState | None:
        """``App.status``: the task's record, or None.

        Args:
            task_id: The task's id.
            queue: The queue whose record answers.

        Returns:
            The record, or None if none is known.

        Raises:
            StateUnavailableError: As ``App.status`` (and every other error it raises).
        """
        return self._run(self.app.status(task_id, queue=queue))

    def result(
        self, task_id: str, *, queue: str | None = None, timeout_s: float = 60.0
    ) -> TaskState:
        """``App.result``: wait for the task's final record.

        Args:
            task_id: The task's id.
            queue: The queue whose record answers.
            timeout_s: How long to wait, in seconds.

        Returns:
            The final record.

        Raises:
            ResultTimeoutError: No final record within ``timeout_s`` (and every other error
                ``App.result`` raises).
        """
        return self._run(self.app.result(task_id, queue=queue, timeout_s=timeout_s))

    def cancel(
        self, task_id: str, *, queue: str | None = None, pending: bool = True
    ) -> Cancellation:
        """``App.cancel``: cancel a task that has not finished.

        Args:
            task_id: The task's id.
            queue: The queue to cancel it in.
            pending: Cancel a task not known yet when it arrives.

        Returns:
            What happened.

        Raises:
            StateUnavailableError: As ``App.cancel`` (and every other error it raises).
        """
        return self._run(self.app.cancel(task_id, queue=queue, pending=pending))

    def stream(
        self, task_id: str, after: str | None = None, *, queue: str | None = None
    ) -> Iterator[StreamEvent]:
        """``App.stream`` as a plain iterator, for a streaming response of a sync view.

        Args:
            task_id: The task's id.
            after: The id of the last event already seen.
            queue: Whose final state ends the stream.

        Returns:
            The task's events, ending with its final event.

        Raises:
            ConfigurationError: As ``App.stream``, when iterated.
            StateUnavailableError: While iterating: Redis fails.
        """

        async def opened() -> AsyncIterator[StreamEvent]:
            return self.app.stream(task_id, after, queue=queue)

        async def step(events: AsyncIterator[StreamEvent]) -> StreamEvent | None:
            try:
                return await anext(events)
            except StopAsyncIteration:  # a Future cannot carry it: None ends the iteration
                return None

        events = self._run(opened())
        try:
            while (event := self._run(step(events))) is not None:
                yield event
        finally:
            closing = getattr(events, "aclose", None)
            if closing is not None:
                self._run(closing())

    def close(self) -> None:
        """Close the App on the background loop (``App.close``); the next call reopens."""
        if self.used:
            self._run(self.app.close())
            self.used = False

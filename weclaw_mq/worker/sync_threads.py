"""The threads a worker runs its plain-``def`` handlers in: at most ``size``, made as calls need
them, shut down with the worker.

A call in a thread cannot be cancelled. When the awaiting delivery gives up on it (its
timeout, a cancel request, the worker stopping hard), a call still waiting for a thread is
dropped, and a running one is abandoned: its outcome is ignored, and it keeps its thread,
counted as running, until it really returns. So abandoned calls never make the pool run more
than ``size`` calls at once.

The handler's timeout does not run while a call waits for a thread (it resumes when one
takes it): a call waits for a thread up to its handler's timeout, and one that got none, or
that came while every thread is held by an abandoned call (none can come back on its own), is
not started and raises ``NoThreadFree``; the delivery parks the task without spending an
attempt. One pool serves every plain-def handler of the worker (a pool per handler would
multiply the threads, and the handler that hangs would still starve its own tasks): what
keeps an innocent task safe is that waiting never costs it an attempt, and ``stuck`` puts the
pool on ``/healthz``.

The threads are daemon threads, not ``concurrent.futures``' (which the interpreter joins at
exit): a call that never returns must not keep a stopped worker's process alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

from weclaw_mq.settings import DEFAULT_SYNC_THREADS
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.deadlines import Deadline

log = logging.getLogger("weclaw_mq.worker")


class NoThreadFree(Exception):
    """No thread took a plain-def call: it was not started (the delivery defers the task,
    no attempt spent)."""


@dataclass(slots=True)
class _Call:
    future: Future[Any]
    func: Callable[..., Any]
    args: tuple[Any, ...]
    # The delivery's context vars (its trace ids, its span): the handler's log lines carry them.
    context: contextvars.Context
    # Called (from the thread) as a thread takes the call: the handler's clock starts.
    on_start: Callable[[], object] | None = None


@dataclass
class _Generation:
    """The threads of one start-to-shutdown of the pool, with their queue and counts (guarded
    by the pool's lock): a shutdown leaves them to finish on their own counts."""

    work: SimpleQueue[_Call | None] = field(default_factory=SimpleQueue)
    threads: int = 0
    queued: int = 0  # calls put on ``work`` and not yet taken by a thread
    running: int = 0  # calls in a thread, abandoned ones included
    abandoned: int = 0  # running calls whose delivery gave up on them


def _answer(taken: asyncio.Future[bool], started: bool) -> None:
    if not taken.done():  # the first answer stands (a thread, or the timer)
        taken.set_result(started)


class SyncThreads:
    """A bounded pool of daemon threads for plain-``def`` handlers (one per worker).

    Args:
        size: The most threads, so the most calls running at once (``sync_threads``).
    """

    def __init__(self, size: int = DEFAULT_SYNC_THREADS) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one thread, got {size}")
        self.size = size
        self._lock = threading.Lock()
        self._now: _Generation | None = None  # None until the first call, and after shutdown
        self._said_full = False  # warned that abandoned calls hold every thread

    @property
    def threads(self) -> int:
        """Threads started (they live until the shutdown)."""
        now = self._now
        return 0 if now is None else now.threads

    @property
    def running(self) -> int:
        """Calls in a thread now, abandoned ones included: at most ``size``."""
        now = self._now
        return 0 if now is None else now.running

    @property
    def abandoned(self) -> int:
        """Calls still running whose delivery ended without them."""
        now = self._now
        return 0 if now is None else now.abandoned

    @property
    def stuck(self) -> bool:
        """Every thread is held by an abandoned call: no plain-def call can start until one
        returns on its own (``/healthz`` says so; a restart frees them)."""
        return self.abandoned >= self.size

    async def run(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        name: str,
        deadline: Deadline,
        watch: Watch,
    ) -> Any:
        """Call ``func(*args)`` in a thread and wait for what it returns or raises.

        Args:
            func: The handler.
            args: Its arguments.
            name: The handler's name, for the log lines.
            deadline: The deadline the wait is under (it says a give-up was a timeout).
            watch: The delivery's cancel requests (it says a give-up was a cancel).

        Returns:
            What ``func`` returned.

        Raises:
            BaseException: What ``func`` raised; ``CancelledError`` when the wait is
                cancelled, and then the call is dropped or abandoned.
        """
        loop = asyncio.get_running_loop()
        # True once a thread took the call, False when none did within the handler's timeout.
        taken: asyncio.Future[bool] = loop.create_future()
        call = _Call(
            Future(),
            func,
            args,
            contextvars.copy_context(),
            lambda: loop.call_soon_threadsafe(_answer, taken, True),
        )
        now = self._enqueue(call)
        waiting = asyncio.wrap_future(call.future)
        asked = time.monotonic()
        deadline.hold()  # the handler's clock starts when a thread takes the call
        # A plain await on a future, not wait_for: a cancel that meets the answer (Python
        # 3.11's wait_for may swallow it then) still ends the wait.
        timer = loop.call_later(deadline.timeout_s, _answer, taken, False)
        try:
            if not await taken and call.future.cancel():  # unstarted: it never will be
                raise NoThreadFree(
                    f"waited {time.monotonic() - asked:.3g} s for a thread; none free "
                    f"({self.running} of {self.size} busy, {self.abandoned} of them past "
                    "their timeout)"
                )
            timer.cancel()
            deadline.restart()
            return await waiting
        except NoThreadFree:
            waiting.cancel()
            raise
        except BaseException:
            timer.cancel()
            self._gave_up(call, now, name, deadline, watch)
            raise

    def _enqueue(self, call: _Call) -> _Generation:
        """Put ``call`` on the work queue, with one more thread if none is idle (up to ``size``).

        Raises:
            NoThreadFree: Abandoned calls hold every thread: the call is not queued.
        """
        with self._lock:
            now = self._now
            if now is None:
                now = self._now = _Generation()
            if now.abandoned >= self.size:
                raise NoThreadFree(
                    f"no sync thread free: all {self.size} are held by calls past their "
                    "timeout, still running"
                )
            now.queued += 1
            # A thread per call waiting for one, up to ``size``: abandoned calls keep theirs.
            start = now.threads < self.size and now.queued > now.threads - now.running
            if start:
                now.threads += 1
        if start:
            threading.Thread(
                target=self._serve,
                args=(now,),
                name=f"weclaw-mq-sync-{now.threads}",
                daemon=True,
            ).start()
        now.work.put(call)
        return now

    def _gave_up(
        self, call: _Call, now: _Generation, name: str, deadline: Deadline, watch: Watch
    ) -> None:
        """The wait ended without the call's outcome: drop it if it has not started, else
        leave it running and count it abandoned until it returns."""
        if call.future.cancel() or call.future.done():
            return  # never started (its thread skips it), or its outcome was raised just now
        with self._lock:
            now.abandoned += 1
            held = now.abandoned
            say_full = held >= self.size and not self._said_full  # once per time it fills up
            if say_full:
                self._said_full = True
        if say_full:
            log.warning(
                "all %d sync threads are held by abandoned calls (past their timeout or "
                "cancelled, still running): plain-def tasks are deferred, no attempt spent, "
                "until one returns, and /healthz says so (raise WECLAW_MQ_SYNC_THREADS, or "
                "give the blocking calls a timeout of their own)",
                self.size,
            )
        if watch.requested:
            log.info(
                "sync handler %s was cancelled while running: its thread is left to see "
                "ctx.cancelled and return (%d of %d sync threads held by abandoned calls)",
                name,
                held,
                self.size,
            )
        else:
            log.warning(
                "sync handler %s abandoned in its thread %s (a thread cannot be killed): its "
                "outcome is ignored and its thread stays busy until it returns (%d of %d sync "
                "threads held by abandoned calls)",
                name,
                f"at its timeout of {deadline.timeout_s:g} s"
                if deadline.expired
                else "as the worker stopped",
                held,
                self.size,
            )
        since = time.monotonic()

        def returned(_: Future[Any]) -> None:  # in the call's thread, or here if it just ended
            with self._lock:
                now.abandoned -= 1
                if now.abandoned < self.size:
                    self._said_full = False
            log.info(
                "abandoned sync handler %s returned %.3g s after it was abandoned; its outcome "
                "is dropped",
                name,
                time.monotonic() - since,
            )

        call.future.add_done_callback(returned)

    def _serve(self, now: _Generation) -> None:
        """One thread: run calls until the shutdown's ``None``."""
        while True:
            call = now.work.get()
            if call is None:
                return
            self._run_one(now, call)
            del call  # an idle thread holds no task, context or result

    def _run_one(self, now: _Generation, call: _Call) -> None:
        with self._lock:  # one step: a taken call is never counted as neither queued nor running
            now.queued -= 1
            started = call.future.set_running_or_notify_cancel()
            if started:
                now.running += 1
        if not started:
            return  # its delivery gave up before it started
        if call.on_start is not None:
            # A closed loop (RuntimeError): the worker is gone, no one waits for the call.
            with contextlib.suppress(RuntimeError):
                call.on_start()
        error: BaseException | None = None
        result: Any = None
        try:
            result = call.context.run(call.func, *call.args)
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()  # never to be awaited: no "never awaited" warning either
                raise TypeError(
                    f"the plain-def handler {getattr(call.func, '__qualname__', call.func)!r} "
                    "returned an awaitable: declare it 'async def' to run on the event loop"
                )
        except StopIteration as e:
            # An asyncio future refuses StopIteration; a coroutine turns it into this too.
            error = RuntimeError("the handler raised StopIteration")
            error.__cause__ = e
        except BaseException as e:  # the handler's failure, whatever it is (as async)
            error = e
        # The thread is free before anyone hears the outcome: the count is never behind it.
        with self._lock:
            now.running -= 1
        if error is None:
            call.future.set_result(result)
        else:
            call.future.set_exception(error)

    def shutdown(self) -> None:
        """Let every thread end once its call returns; the next call starts the pool anew.

        An abandoned call still running keeps its (daemon) thread until it returns; it no
        longer counts against the new pool's ``size``.
        """
        with self._lock:
            now, self._now = self._now, None
            self._said_full = False
        if now is not None:
            for _ in range(now.threads):
                now.work.put(None)

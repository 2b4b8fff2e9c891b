"""Running a worker as a process: signals, metrics endpoint, and an exit with a hard bound.

The first SIGTERM or SIGINT stops the worker: no new deliveries, in-flight handlers get
``shutdown_grace_s``, then are cancelled and give their messages back. Whatever a handler
does (ignores its cancellation, blocks the event loop in a synchronous call), the process
exits within ``shutdown_grace_s + HARD_EXIT_MARGIN_S``: a watchdog thread ends it then, and
the broker returns every message it still held to its queue. A second signal ends it at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Sequence
from importlib import import_module
from types import FrameType

from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.worker import event_loop
from weclaw_mq.worker.consume import Worker
from weclaw_mq.worker.event_loop import EventLoopName

log = logging.getLogger("weclaw_mq.worker")

# Past the grace: cancelled handlers give their messages back (worker.draining.DRAIN_CANCEL_S),
# the connection and Redis close (a few seconds each at most); then the watchdog ends the process.
HARD_EXIT_MARGIN_S = 10.0
# Exit status of a stop the watchdog (or a second signal) had to force.
FORCED_EXIT_CODE = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def preload(app: App, *, loop: EventLoopName, metrics: bool) -> None:
    """Import now what a worker of ``app`` imports when it starts (the Redis store, the
    metrics server, uvloop), opening nothing: the supervisor does it once, before it forks
    its children (``cli.supervisor``). A missing uvloop is its one-line error here."""
    event_loop.loop_factory(loop)
    if app.needs_store or any(s.limits for s in app.handlers.values()):
        import_module("weclaw_mq.state.redis")
        import_module("weclaw_mq.streaming.redis")
    if metrics:
        import_module("weclaw_mq.observability.metrics_server")


async def run_worker(
    app: App,
    *,
    concurrency: int | None,
    queues: Sequence[str] | None,
    metrics_port: int | None,
    broker_load_check: bool | None = None,
    schedules: bool | None = None,
) -> None:
    worker = Worker(
        app,
        concurrency=concurrency,
        queues=queues,
        broker_load_check=broker_load_check,
        schedules=schedules,
    )
    port = metrics_port if metrics_port is not None else app.settings.metrics_port
    server = None
    if port is not None:
        addr = app.settings.metrics_addr
        try:
            server = app.metrics.serve(port, addr, health=worker.health)
        except OSError as e:  # taken, or an address this host does not have: a setting to fix
            raise ConfigurationError(
                f"cannot serve metrics on {addr}:{port}: {e.strerror or e} "
                "(--metrics-port, WECLAW_MQ_METRICS_PORT, WECLAW_MQ_METRICS_ADDR)"
            ) from None
        log.info("metrics on %s:%d/metrics, health on /healthz", addr, server.port)
    stopper = _Stopper(worker, asyncio.get_running_loop())
    try:
        await worker.run()
        await app.close()
    finally:
        stopper.restore()
        if server is not None:
            server.close()
    if worker.abandoned:
        # asyncio.run would cancel them and wait for them to end, which they never do.
        _hard_exit(
            f"worker stopped; {worker.abandoned} handler(s) that ignore cancellation are "
            "still running: exiting without them"
        )
    log.info("worker stopped")


class _Stopper:
    """Plain ``signal.signal`` handlers, not the loop's: they run in the main thread even while
    a handler blocks the event loop, so the watchdog starts whatever the loop is doing."""

    def __init__(self, worker: Worker, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        self.signalled = False
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        # A forked child of the supervisor starts with them blocked: they come in here now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signalled:
            _hard_exit(f"{name} again: exiting now; unfinished tasks go back to their queues")
        self.signalled = True
        bound_s = self.worker.shutdown_grace_s + HARD_EXIT_MARGIN_S
        watchdog = threading.Timer(
            bound_s,
            _hard_exit,
            args=(
                f"still running {bound_s:.0f} s after {name}: exiting now; unfinished tasks "
                "go back to their queues",
            ),
        )
        watchdog.daemon = True
        watchdog.start()
        self.loop.call_soon_threadsafe(self._stop, name)

    def _stop(self, name: str) -> None:
        log.info("%s: finishing in-flight tasks, taking no new ones", name)
        self.worker.stop()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _hard_exit(why: str) -> None:
    # os._exit skips the event loop and its cleanup (which would wait on handlers that never
    # end); the broker requeues whatever this connection held once the socket closes.
    log.error("%s", why)
    logging.shutdown()
    os._exit(FORCED_EXIT_CODE)

"""Running a worker as a process: signals, metrics endpoint, clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

from ..app import App
from ..worker import Worker

log = logging.getLogger("weclaw_mq.worker")


async def run_worker(
    app: App,
    *,
    concurrency: int | None,
    queues: Sequence[str] | None,
    metrics_port: int | None,
) -> None:
    worker = Worker(app, concurrency=concurrency, queues=queues)
    port = metrics_port if metrics_port is not None else app.settings.metrics_port
    if port is not None:
        app.metrics.serve(port)
        log.info("metrics on :%d/metrics", port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, worker, sig)
    try:
        await worker.run()
    finally:
        await app.close()
    log.info("worker stopped")


def _on_signal(worker: Worker, sig: signal.Signals) -> None:
    log.info("%s: finishing in-flight tasks, taking no new ones", sig.name)
    worker.stop()

"""What a worker checks and says once as it starts: its Redis pool is large enough, and warnings
about sync threads, RabbitMQ's consumer timeout, an unanswering Redis and a loaded broker.

A mixin of ``consume.Worker``: it reads the worker's attributes declared below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from weclaw_mq.app import App
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.settings import BROKER_CONSUMER_TIMEOUT_S, Settings
from weclaw_mq.wire.broker_load import read_broker_load
from weclaw_mq.worker.cancel_watch import Cancels
from weclaw_mq.worker.sync_threads import SyncThreads

log = logging.getLogger("weclaw_mq.worker")

# The most connections one of a worker's Redis pools takes, whatever its concurrency: the
# store's auto-pipeline (one round trip at a time), its cancel subscription and one lone
# command (state.redis); the stream store's writes (streaming.redis.WRITES_IN_FLIGHT); the
# limiter's round trips (llm.limiting.ROUND_TRIPS_IN_FLIGHT) and its renewer.
REDIS_CONNECTIONS_NEEDED = 8


class StartChecks:
    """The worker's checks and warnings at start (``Worker.run``)."""

    app: App
    settings: Settings
    specs: list[HandlerSpec]
    concurrency: int
    sync_threads: SyncThreads
    cancels: Cancels

    def _check_redis_pool(self) -> None:
        if self.app.store is None:
            return
        if self.settings.redis_max_connections < REDIS_CONNECTIONS_NEEDED:
            raise ConfigurationError(
                f"a worker needs up to {REDIS_CONNECTIONS_NEEDED} Redis connections per pool, "
                f"over WECLAW_MQ_REDIS_MAX_CONNECTIONS={self.settings.redis_max_connections}; "
                "raise it"
            )

    def _warn_about_sync_threads(self) -> None:
        sync = [s.queue for s in self.specs if s.is_sync]
        if len(sync) * self.concurrency > self.sync_threads.size:
            log.warning(
                "plain-def handler(s) of %s may run %d calls at once (concurrency %d each), "
                "over WECLAW_MQ_SYNC_THREADS=%d: the calls beyond it wait for a thread under "
                "their timeout",
                ", ".join(sync),
                len(sync) * self.concurrency,
                self.concurrency,
                self.sync_threads.size,
            )

    def _warn_about_consumer_timeout(self) -> None:
        for spec in self.specs:
            if spec.timeout_s >= BROKER_CONSUMER_TIMEOUT_S and not spec.long_running:
                log.warning(
                    "handler for %r may run %.0f s, past RabbitMQ's consumer_timeout (30 min by "
                    "default): the broker would close the channel and requeue its messages. "
                    "Make it @app.handler(..., long_running=True) (docs/how-to/long-runs.md), "
                    "or raise it in rabbitmq.conf, e.g. 'consumer_timeout = %d' (milliseconds)",
                    spec.queue,
                    spec.timeout_s,
                    int(spec.timeout_s * 1000 * 2),
                )

    async def _say_if_redis_is_away(self) -> None:
        """Once, at start: a Redis that does not answer, and what the worker does meanwhile
        (it consumes, and the log would otherwise look healthy); then once when it answers."""
        wait_s = self.settings.redis_timeout_s + 1.0  # a refused connect fails well before
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.cancels.listening.wait(), wait_s)
            return
        meanwhile = []
        if any(s.idempotent for s in self.specs):
            if self.settings.guard_on_redis_down == "run_unguarded":
                meanwhile.append("guarded tasks run UNGUARDED (GUARD_ON_REDIS_DOWN=run_unguarded)")
            else:
                meanwhile.append("guarded tasks wait in their delay queues, never run unguarded")
        if self.app.results is not None:
            meanwhile.append(
                "results cannot be stored (a finished task goes back to its queue after "
                f"{self.settings.result_store_patience_s:g} s)"
            )
        meanwhile.append("cancel requests go unheard")
        log.warning(
            "Redis at %s does not answer (no reply within %.0f s): the worker consumes, but "
            "until Redis answers %s",
            self.settings.redis_url_redacted(),
            wait_s,
            "; ".join(meanwhile),
        )
        await self.cancels.listening.wait()
        log.info("Redis answers now: guarded tasks run, cancel requests are heard")

    async def _warn_about_broker_load(self) -> None:
        """One line at start when the broker is within 10 % of its file-handle or memory
        limit, where that can be read at all (``broker_load``)."""
        url = self.settings.amqp_urls()[0]
        load = await asyncio.to_thread(read_broker_load, url)
        if load is not None and (warning := load.warning()) is not None:
            log.warning("%s", warning)

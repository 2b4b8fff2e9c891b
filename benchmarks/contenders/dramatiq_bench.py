"""Dramatiq 2 (``RabbitmqBroker``, pika, worker threads) on the same broker.

Dramatiq declares its own queues (``Q``, ``Q.DQ`` delay, ``Q.XQ`` dead letters); a subclass
adds ``x-queue-type: quorum`` to the arguments it builds for ``Q`` and ``Q.DQ`` so the work
queue is quorum like everyone else's (``Q.XQ`` stays classic: nothing reaches it here).
concurrency = worker threads, and the worker's prefetch is set to the same number (its
default is twice the threads). Dramatiq acks after the actor returned; its actors are sync.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Middleware

from ..common import ChildConfig, Tracker, emit

ACTOR_NAME = "bench_noop"


class QuorumRabbitmqBroker(RabbitmqBroker):
    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-queue-type"] = "quorum"
        return arguments


class Hooks(Middleware):
    """First delivery (a worker thread picks the message up) and every ack, under a lock:
    worker threads ack concurrently."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.lock = threading.Lock()

    def before_process_message(self, broker: Any, message: Any) -> None:
        if not self.tracker.first_ns:
            with self.lock:
                self.tracker.delivered()

    def after_ack(self, broker: Any, message: Any) -> None:
        with self.lock:
            self.tracker.acked_one()


def expect(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} from the orchestrator, got {line!r}")


def main() -> None:
    cfg = ChildConfig.from_argv()
    done = threading.Event()
    tracker = Tracker(cfg.count, done.set)
    broker = QuorumRabbitmqBroker(url=cfg.amqp_url)
    broker.add_middleware(Hooks(tracker))
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=cfg.queue, actor_name=ACTOR_NAME, broker=broker)
    def bench_noop(task: dict[str, Any]) -> None:
        return None

    broker.declare_queue(cfg.queue, ensure=True)  # before "ready": the orchestrator fills it
    worker = dramatiq.Worker(broker, worker_threads=cfg.concurrency)
    worker.queue_prefetch = cfg.concurrency
    emit("ready")
    expect("go")
    worker.start()
    if not done.wait(timeout=cfg.extra.get("timeout_s", 600)):
        raise SystemExit("dramatiq: timed out before the last ack")
    emit("done", **tracker.result())
    expect("stop")
    worker.stop()
    broker.close()


if __name__ == "__main__":
    main()

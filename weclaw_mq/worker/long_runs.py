"""Runs that outlive the broker's consumer timeout (``@app.handler(..., long_running=True)``).

RabbitMQ closes a channel whose delivery stays unacked past ``consumer_timeout`` (30 min by
default; 4.3 cancels the consumer), so a worker that holds its delivery until the result is
stored cannot run longer. A long run holds no delivery:

1. its delivery passes the gates and the guard's claim as any other;
2. the run takes the task's next watch generation (``state.watches``), publishes a *watch
   copy* of the task with it (confirmed) to the handler's delay queue of about
   ``long_run_watch_s``, and only then acks the delivery: from that instant the copy is the
   task's home on the broker, and the delivery is held for milliseconds;
3. the claim's lease and this worker's heartbeat are renewed by the task store's own renewer,
   whatever the handler awaits (no call of the user's);
4. each time the copy comes back, the worker that gets it asks the guard: the task done →
   acked; the run alive → parked again for a period (one publish per period); the copy stale
   (the run ended, or a newer copy exists) → acked, nothing run; the run's worker gone (its
   heartbeat lapsed) → the copy claims the task and the run resumes, its steps memoized
   (``ctx.step``);
5. the run's end is carried out as any delivery's, but its move (a retry, a deferral, the DLQ)
   is published first and the watch ended after it (``ended``), so the task is never off the
   broker; its ack has nothing left to send (``Settler._settle``);
6. a worker that stops hands its long runs over at once (``hand_over``): the claim released,
   a copy of the next generation straight to the queue, the watch raised to it; another
   worker resumes the run within a delivery.

A run whose worker died resumes within ``long_run_watch_s`` (as served by the delay queue
chosen) plus ``guard_heartbeat_ttl_s``: the copy comes back at most one period after the
death, and the claim is free once the heartbeat lapsed (else it parks once more).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.message import Delivery
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.policy.delays import next_hop_ms
from weclaw_mq.policy.retry import delay_queue_set
from weclaw_mq.settings import Settings
from weclaw_mq.state.watches import WatchStep
from weclaw_mq.worker.records import release
from weclaw_mq.worker.runtime import Runtime

log = logging.getLogger("weclaw_mq.worker")

__all__ = ["LongRun", "LongRuns", "detach", "ended", "hand_over", "hop_ms", "watch_generation"]


@dataclass(frozen=True, slots=True)
class LongRun:
    """A run that holds no delivery: the watch generation its copy carries, and the copy's
    period."""

    generation: int
    hop_ms: int


def hop_ms(spec: HandlerSpec, settings: Settings) -> int:
    """The watch copy's period: the longest of the handler's delay queues not longer than
    ``long_run_watch_s`` (a queue of its own per value would grow without bound)."""
    return next_hop_ms(int(settings.long_run_watch_s * 1000), delay_queue_set(spec.retry))


def watch_generation(delivery: Delivery) -> int | None:
    """The generation a watch copy carries, None for any other delivery."""
    value = delivery.headers.get(h.WATCH)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class LongRuns:
    """A worker's long runs in flight, per handler queue: a stop hands them over at once, and
    a queue full of them takes no more deliveries (``room``) until one ends.

    Its delivery acked, a long run no longer counts against the consumer's prefetch: without
    this a worker would take every task of the queue at once."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.tasks: dict[asyncio.Task[Any], str] = {}
        # Called with a queue that became full (True) or has room again (False): its consumer
        # pauses or resumes. Told only of changes (a resume per ended run would race others
        # and add consumers), and set per session (``attach``).
        self._on_full: Callable[[str, bool], None] | None = None
        self._full: set[str] = set()

    def attach(self, on_full: Callable[[str, bool], None] | None) -> None:
        """A session's consumers (None: the session ended). A new session's consumers start
        consuming: those of queues already full are paused at once."""
        self._on_full = on_full
        if on_full is not None:
            for queue in self._full:
                on_full(queue, True)

    def count(self, queue: str) -> int:
        return sum(1 for q in self.tasks.values() if q == queue)

    def full(self, queue: str) -> bool:
        """This worker runs as many long runs of ``queue`` as its concurrency."""
        return self.count(queue) >= self.concurrency

    def add(self, queue: str) -> None:
        """The current task's run is a long run of ``queue`` from now until it ends."""
        task = asyncio.current_task()
        if task is None:
            return
        self.tasks[task] = queue
        task.add_done_callback(self._gone)
        if queue not in self._full and self.full(queue):
            self._full.add(queue)
            if self._on_full is not None:
                self._on_full(queue, True)

    def _gone(self, task: asyncio.Task[Any]) -> None:
        queue = self.tasks.pop(task, None)
        if queue is not None and queue in self._full and not self.full(queue):
            self._full.discard(queue)
            if self._on_full is not None:
                self._on_full(queue, False)


async def detach(
    rt: Runtime, spec: HandlerSpec, delivery: Delivery, message: AbstractIncomingMessage
) -> LongRun | None:
    """Make the claimed delivery a long run: its next watch generation, its watch copy out
    (confirmed), its delivery acked. None when that could not be done: the store failed (the
    delivery is still held) or the copy's publish did (the settler gave the delivery back)."""
    assert rt.store is not None
    try:
        generation = await rt.store.watch(
            spec.queue, delivery.task_id, watch_generation(delivery) or 0, WatchStep.START
        )
    except Exception as e:
        log.warning("could not start the long run's watch (%s); the task goes back", e)
        return None
    period = hop_ms(spec, rt.settings)
    moved = await rt.settler.watch(
        message,
        delivery,
        queue=spec.queue,
        hop_ms=period,
        generation=generation,
    )
    if not moved:  # given back by the settler: the broker holds the task again
        return None
    if rt.long_runs is not None:
        rt.long_runs.add(spec.queue)
    return LongRun(generation, period)


async def ended(
    rt: Runtime,
    spec: HandlerSpec,
    delivery: Delivery,
    run: LongRun,
    held: str | None,
    *,
    moved: bool,
) -> None:
    """After a long run's end that did not finish the task was carried out: its watch ended
    once its next copy is out (``moved``), then its claim released. A move that failed leaves
    the watch as it was: the watch copy brings the task back (its run resumes)."""
    if moved and rt.store is not None:
        try:
            await rt.store.watch(spec.queue, delivery.task_id, run.generation, WatchStep.END)
        except Exception as e:  # its copy comes back and resumes the run: at least once
            log.warning("could not end the long run's watch (%s); its copy may run it again", e)
    elif not moved:
        log.warning(
            "task %s: its next copy could not be published; its watch copy brings it back "
            "within %.3g s",
            delivery.task_id,
            run.hop_ms / 1000,
        )
    await release(rt, spec, delivery, held)


async def hand_over(
    rt: Runtime,
    spec: HandlerSpec,
    delivery: Delivery,
    message: AbstractIncomingMessage,
    run: LongRun,
    held: str | None,
) -> None:
    """This worker will not end the run (it stops, or could not store its end): the claim
    released, then a copy of the next generation straight to the queue, then the watch
    raised to it (older copies stale), so another worker resumes it at once.

    Released first: a copy that found the claim still held would be parked for a whole
    watch period. Until the copy is out the watch copy still counts, so a crash in between
    loses nothing (the watch copy resumes the run); if it comes back first and resumes the
    run, the hand-over's copy is parked beside the new run's until it ends."""
    await release(rt, spec, delivery, held)
    generation = run.generation + 1
    sent = await rt.settler.hand_over(
        message,
        delivery,
        queue=spec.queue,
        generation=generation,
    )
    if sent and rt.store is not None:
        try:
            await rt.store.watch(spec.queue, delivery.task_id, generation, WatchStep.RAISE)
        except Exception as e:  # both copies count: the first to resume makes the other stale
            log.warning("could not raise the long run's watch (%s)", e)

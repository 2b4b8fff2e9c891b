"""A handler queue's circuit breaker at work in one worker: the state machine
(``weclaw_mq.policy.breaker.Circuit``) fed with handler outcomes, and the consumers paused,
probed and resumed as its states say.

OPEN: the queue's consumers (every lane's) are cancelled, so the broker keeps the tasks;
a task delivered before the cancel took effect, or waiting for a slot, is deferred to the
first delay queue (``delivery``), which spends no attempt. After the cool-down, HALF_OPEN:
one task is taken with basic.get (one message exactly, whatever the prefetch) and run as the
probe. Its success closes the circuit and the consumers are resumed; its failure reopens it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.breaker import Breaker, Circuit, CircuitState
from weclaw_mq.policy.failures import describe

log = logging.getLogger("weclaw_mq.worker")


class Pausable(Protocol):
    """The consumers of one handler queue (all its lanes), as the breaker drives them."""

    async def pause(self) -> None:
        """Cancel the consumers: the broker delivers no more of the queue's tasks."""

    async def resume(self) -> None:
        """Consume again as before the pause."""

    async def fetch(self) -> AbstractIncomingMessage | None:
        """One task for the probe (basic.get, highest lane first), or None if none waits."""


class QueueCircuit:
    """One handler queue's breaker for the worker's lifetime (it outlives reconnects)."""

    def __init__(
        self,
        queue: str,
        breaker: Breaker,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.circuit = Circuit(breaker, clock)
        self.metrics = metrics
        self._probe: AbstractIncomingMessage | None = None
        self._opened = asyncio.Event()
        metrics.circuit_state(queue, CircuitState.CLOSED)

    @property
    def state(self) -> CircuitState:
        return self.circuit.state

    def admits(self, message: AbstractIncomingMessage) -> bool:
        """May ``message``'s handler run now? Else it is deferred without an attempt."""
        state = self.circuit.state
        return state is CircuitState.CLOSED or (
            state is CircuitState.HALF_OPEN and message is self._probe
        )

    def outcome(self, message: AbstractIncomingMessage, error: BaseException | None) -> None:
        """How ``message``'s handler ended (``error`` None: it returned)."""
        changed = self.circuit.record(error, probe=message is self._probe)
        if changed is CircuitState.OPEN:
            self._opened.set()
            self._changed(changed, f"after {describe(error)}" if error is not None else "")
        elif changed is not None:
            self._changed(changed, "the probe succeeded")

    async def watch(
        self, consumers: Pausable, start: Callable[[AbstractIncomingMessage], asyncio.Task[None]]
    ) -> None:
        """For one session: pause, probe and resume ``consumers`` as the circuit says;
        ``start`` runs a delivery as the worker does. Returns only if the broker failed us
        (the session then ends and reconnects); cancelled when the session ends."""
        if self.circuit.state is CircuitState.HALF_OPEN:
            # Its probe went with the last connection: no outcome will come for it.
            self._changed(self.circuit.reopen(), "the probe was lost with the connection")
        try:
            while True:
                if self.circuit.state is CircuitState.CLOSED:
                    self._opened.clear()  # set by a reopen that a later probe undid
                    await self._opened.wait()
                await consumers.pause()
                while self.circuit.state is not CircuitState.CLOSED:
                    await self._probe_after_cooldown(consumers, start)
                await consumers.resume()
                log.info("circuit breaker of %r: consuming again", self.queue)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the channel failed under a cancel, consume or get
            log.warning("circuit breaker of %r could not change the consumers (%s)", self.queue, e)

    async def _probe_after_cooldown(
        self, consumers: Pausable, start: Callable[[AbstractIncomingMessage], asyncio.Task[None]]
    ) -> None:
        at = self.circuit.probe_at
        if at is not None:
            await asyncio.sleep(max(0.0, at - self.circuit.clock()))
        if self.circuit.half_open() is None:
            return
        self._changed(CircuitState.HALF_OPEN, "the cool-down is over: one probe task")
        while self.circuit.state is CircuitState.HALF_OPEN:
            message = await consumers.fetch()
            if message is None:
                self._changed(self.circuit.reopen(), "no task to probe with")
                return
            self._probe = message
            try:
                # The probe's task is the worker's (tracked in flight): not cancelled here.
                await asyncio.wait({start(message)})
            finally:
                self._probe = None
            # Still HALF_OPEN: the probe never reached its handler (a duplicate, a task
            # parked by the guard, a bad payload): the next task probes.

    def _changed(self, state: CircuitState | None, why: str) -> None:
        if state is None:
            return
        self.metrics.circuit_state(self.queue, state)
        if state is CircuitState.OPEN:
            self.metrics.circuit_opened(self.queue).inc()
            log.warning(
                "circuit breaker of %r is open%s: not consuming for %.3g s",
                self.queue,
                f" ({why})" if why else "",
                self.circuit.breaker.cooldown_s,
            )
        else:
            log.info("circuit breaker of %r is %s (%s)", self.queue, state, why)

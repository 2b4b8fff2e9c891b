"""One delivery on its way through the worker (``Attempt``), and what every delivery of a
handler passes, made once per worker (``Pipeline``).

The stages of a delivery (``delivery``: the checks, the gates, the run, its ending) read
and set an ``Attempt``, and answer with an ``End`` or None ("go on"); only ``process``
carries the ``End`` out. A stage never settles, releases or publishes a move itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractIncomingMessage

from weclaw_mq.contract.message import Delivery
from weclaw_mq.handlers.middleware import Run
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.worker.cancel_watch import Watch
from weclaw_mq.worker.limiting import NO_TICKET, Ticket

if TYPE_CHECKING:
    from weclaw_mq.observability.metrics import Timing
    from weclaw_mq.worker.ends import End
    from weclaw_mq.worker.pausing import QueueCircuit
    from weclaw_mq.worker.run_hooks import Begun
    from weclaw_mq.worker.runtime import Runtime


class Attempt:
    """One delivery between its read and its settle: the message and what the stages learnt
    of it (its task, the claim it holds, the model it runs on, the slots it holds)."""

    # Slots, set positionally: made for every delivery, so it costs one call and no dict.
    __slots__ = (
        "begun",
        "chained",
        "delivery",
        "held",
        "message",
        "model",
        "outcome",
        "pipeline",
        "recording",
        "reserved",
        "rt",
        "run",
        "spec",
        "taken_over",
        "task",
        "ticket",
        "watch",
    )

    def __init__(
        self,
        message: AbstractIncomingMessage,
        delivery: Delivery,
        spec: HandlerSpec,
        rt: Runtime,
        watch: Watch,
        pipeline: Pipeline,
    ) -> None:
        self.message = message
        self.delivery = delivery
        self.spec = spec
        self.rt = rt
        self.watch = watch
        self.pipeline = pipeline
        self.task: Any = None  # the task as the handler receives it, once decoded
        self.held: str | None = None  # the claim's owner token, while we hold the claim
        self.model: str | None = None  # the model chosen for the run (a cap, a fallback)
        self.chained = False  # the model came from the handler's fallback chain
        # The limits' slots (freed as the handler ends), and a cap's reservation of the run's
        # cost (joined to it before the run).
        self.ticket: Ticket = NO_TICKET
        self.reserved: Ticket = NO_TICKET
        self.begun: Begun | None = None  # the middleware's run, when the App has run hooks
        # The "running" record written beside the handler, while it is being written.
        self.recording: asyncio.Task[None] | None = None
        # How the run ended: (its result, None) or (None, the error); None before it ended,
        # or when it was abandoned (the task that took over ended the attempt).
        self.outcome: tuple[Any, BaseException | None] | None = None
        # The middleware's view of the run, made by its admit hooks (``admit_hooks``) or
        # as its run begins.
        self.run: Run | None = None
        # An admit hook ignored its cancellation past the timeout: another task ended the
        # attempt (``running.take_over``), and this delivery's task settles nothing more.
        self.taken_over = False

    def let_go(self) -> None:
        """Free the slots and the reservation the gates took, for a delivery that a later
        gate stopped before its run."""
        self.reserved.release()
        self.ticket.release()


# A gate of a handler's own (its features): "go on" (None), or the delivery's end.
Gate = Callable[[Attempt], Awaitable["End | None"]]


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What every delivery of one handler passes in this worker, made at its first delivery:
    the handler's own gates in order, its circuit breaker, its timing metric."""

    gates: tuple[Gate, ...]
    circuit: QueueCircuit | None
    timing: Timing

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
from weclaw_mq.handlers.middleware import Chain, Run
from weclaw_mq.handlers.spec import HandlerSpec
from weclaw_mq.worker.cancel_watch import Watch

if TYPE_CHECKING:
    from weclaw_mq.observability.metrics import Timing
    from weclaw_mq.worker.ends import End
    from weclaw_mq.worker.long_runs import LongRun
    from weclaw_mq.worker.pausing import QueueCircuit
    from weclaw_mq.worker.run_hooks import Begun
    from weclaw_mq.worker.runtime import Runtime


class Attempt:
    """One delivery between its read and its settle: the message and what the stages learnt
    of it (its task, the claim it holds, the model it runs on, the slots it holds)."""

    # Slots, set positionally: made for every delivery, so it costs one call and no dict.
    __slots__ = (
        "admitted",
        "begun",
        "delivery",
        "held",
        "long_run",
        "message",
        "model",
        "outcome",
        "pipeline",
        "recording",
        "rt",
        "run",
        "spec",
        "taken_over",
        "task",
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
        # Its delivery acked as the run began (``worker.long_runs``), its watch copy out.
        self.long_run: LongRun | None = None
        self.model: str | None = None  # the model an admit hook chose for the run (run.model)
        # The middleware's admit hooks let the run through, and its after_call (or let_go)
        # hooks have not been told how it ended yet.
        self.admitted = False
        self.begun: Begun | None = None  # the middleware's run, when the App has run hooks
        # The "running" record written beside the handler, while it is being written.
        self.recording: asyncio.Task[None] | None = None
        # How the run ended: (its result, None) or (None, the error); None before it ended,
        # or when it was abandoned (the task that took over ended the attempt).
        self.outcome: tuple[Any, BaseException | None] | None = None
        # The middleware's view of the run, made by its admit hooks (``admit_hooks``) or
        # as its run begins.
        self.run: Run | None = None
        # A middleware hook (an admit or after_call hook: which, said here) ignored its
        # cancellation past the timeout: another task ended the attempt
        # (``running.take_over``), and this delivery's task settles nothing more.
        self.taken_over = ""

    def let_go(self) -> None:
        """Tell the middleware that let the run through that its call will not end here (a
        hard stop, an abandoned handler): they free what they took (a slot, a reservation)."""
        if self.admitted:
            self.admitted = False
            hooks = self.pipeline.hooks
            if hooks is not None and self.run is not None:
                hooks.let_go(self.run)


# A gate of a handler's own (its features): "go on" (None), or the delivery's end.
Gate = Callable[[Attempt], Awaitable["End | None"]]


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What every delivery of one handler passes in this worker, made at its first delivery:
    its gates in order, its circuit breaker, its timing metric, and its middleware (the
    App's, then its own: ``App.handler_chain``), None when no hook runs."""

    gates: tuple[Gate, ...]
    circuit: QueueCircuit | None
    timing: Timing
    hooks: Chain | None

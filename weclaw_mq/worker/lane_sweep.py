"""The lanes' held-delivery net (``HeldSweep``): a delivery waiting unstarted for ``bound_s``
while a slot is free, which no state of the lane scheduler (``worker.lanes``) should allow, is
logged, counted (``on_held``) and handed to ``held``, which gives it back.

A sweep runs every ``bound_s / 2`` over the waiting deliveries only (at most the scheduler's
cap): it remembers when it first saw each one waiting, rebuilt by every sweep, so nothing is
kept or timed per delivery.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping

from aio_pika.abc import AbstractIncomingMessage

log = logging.getLogger("weclaw_mq.worker")

# A delivery held unstarted this long while a slot is free is given back (settings:
# WECLAW_MQ_HELD_DELIVERY_S): no state of ours should ever allow it, so it is a bug's net.
HELD_BOUND_S = 30.0


class HeldSweep:
    """Sweeps ``waiting`` (each lane's waiting deliveries, the scheduler's own deques) every
    ``bound_s / 2`` from ``arm`` until ``stop``; ``free``: a slot is free now; ``swept``:
    called after every sweep (the scheduler starts what it can)."""

    def __init__(
        self,
        waiting: Mapping[str, deque[AbstractIncomingMessage]],
        *,
        bound_s: float,
        free: Callable[[], bool],
        held: Callable[[str, AbstractIncomingMessage], None],
        swept: Callable[[], None],
        on_held: Callable[[], None] | None = None,
    ) -> None:
        self._waiting = waiting
        self.bound_s = bound_s
        self._free = free
        self._held = held
        self._swept = swept
        self._on_held = on_held
        # id of each waiting delivery -> the loop time a sweep first saw it waiting
        self._seen: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = False

    def arm(self) -> None:
        """The next sweep in ``bound_s / 2`` (none once stopped)."""
        if not self._stopped:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.bound_s / 2, self.sweep)

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def sweep(self) -> None:
        """Hand every delivery held ``bound_s`` while a slot is free to ``held``; arm again."""
        self._timer = None
        now = asyncio.get_running_loop().time()
        seen, self._seen = self._seen, {}
        free = self._free()
        for lane, waiting in self._waiting.items():
            for message in list(waiting):
                since = seen.get(id(message), now)
                if not (free and now - since >= self.bound_s):
                    self._seen[id(message)] = since
                    continue
                waiting.remove(message)
                log.warning(
                    "task %s of %s was held %.0f s without starting while a slot was free; "
                    "giving it back",
                    message.message_id,
                    lane,
                    now - since,
                )
                if self._on_held is not None:
                    self._on_held()
                self._held(lane, message)
        self._swept()
        self.arm()

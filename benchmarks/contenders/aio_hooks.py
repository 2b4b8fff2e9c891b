"""The delivery and ack hooks for every contender built on aio-pika (raw, weclaw_mq, FastStream).

Patching aio-pika's ``IncomingMessage`` (not each contender's own code) makes "first delivery"
and "last ack" the same two events for all three, at the same cost: one extra call each.
weclaw_mq's worker builds its messages with its own constructor (``weclaw_mq.worker.incoming``,
a subclass that does not call aio-pika's): that constructor is counted the same way.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from aio_pika import message as aio_message


class Counter(Protocol):
    """What the hooks call: ``common.Tracker``, or a process's slot (``weclaw_processes``)."""

    def delivered(self) -> None: ...

    def acked_one(self) -> None: ...


def track(tracker: Counter) -> None:
    cls = aio_message.IncomingMessage
    ack = cls.ack
    classes = [cls]
    # Only where the contender imported it (weclaw_mq's worker): raw aio-pika and FastStream
    # must not pay for importing weclaw_mq.
    ours = sys.modules.get("weclaw_mq.worker.incoming")
    if ours is not None:
        classes.append(ours.Incoming)
    for made in classes:
        _count_init(made, tracker)

    async def counted_ack(self: Any, *args: Any, **kwargs: Any) -> None:
        await ack(self, *args, **kwargs)
        tracker.acked_one()

    cls.ack = counted_ack  # type: ignore[method-assign]


def _count_init(cls: type, tracker: Counter) -> None:
    init = cls.__init__

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        tracker.delivered()

    cls.__init__ = counted_init  # type: ignore[misc]

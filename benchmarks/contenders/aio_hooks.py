"""The delivery and ack hooks for every contender built on aio-pika (raw, weclaw_mq, FastStream).

Patching aio-pika's ``IncomingMessage`` (not each contender's own code) makes "first delivery"
and "last ack" the same two events for all three, at the same cost: one extra call each.
"""

from __future__ import annotations

from typing import Any, Protocol

from aio_pika import message as aio_message


class Counter(Protocol):
    """What the hooks call: ``common.Tracker``, or a process's slot (``weclaw_processes``)."""

    def delivered(self) -> None: ...

    def acked_one(self) -> None: ...


def track(tracker: Counter) -> None:
    cls = aio_message.IncomingMessage
    init = cls.__init__
    ack = cls.ack

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        tracker.delivered()

    async def counted_ack(self: Any, *args: Any, **kwargs: Any) -> None:
        await ack(self, *args, **kwargs)
        tracker.acked_one()

    cls.__init__ = counted_init  # type: ignore[method-assign]
    cls.ack = counted_ack  # type: ignore[method-assign]

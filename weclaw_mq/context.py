"""The typed context a handler receives as its second argument."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import App


@dataclass(frozen=True)
class Context:
    task_id: str
    trace_id: str
    queue: str
    attempt: int
    redelivered: bool
    headers: Mapping[str, Any]
    app: App = field(repr=False)
    # Every line logged through it (or any logger, via TraceLogFilter) carries the task's ids.
    logger: logging.Logger = field(default=logging.getLogger("weclaw_mq.handler"), repr=False)
    # Set when the task is cancelled (``App.cancel``); the handler is then cancelled too
    # (a CancelledError at its next await), and may wait on this in a task of its own.
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        """Was the task cancelled (``App.cancel``)? Its outcome no longer counts."""
        return self.cancel_requested.is_set()

    async def publish(self, queue: str, payload: Any, **kwargs: Any) -> str:
        """Publish a follow-up task; it inherits this task's trace id."""
        return await self.app.publish(queue, payload, trace_id=self.trace_id, **kwargs)

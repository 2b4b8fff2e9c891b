"""What the workflows need of the ``App`` that runs them: its publishing, stores and metrics.

A Protocol, so this room sits below ``app.py`` (which passes itself) and the worker (which
passes its ``App``) without importing either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from aio_pika.abc import HeadersType

from weclaw_mq.observability.metrics import Metrics
from weclaw_mq.policy.priority import Priority
from weclaw_mq.settings import Settings
from weclaw_mq.state import TaskStore


class Host(Protocol):
    """The ``App``, as the workflows use it."""

    settings: Settings
    metrics: Metrics

    @property
    def store(self) -> TaskStore | None:
        """The task store (claims and records)."""
        ...

    @property
    def results(self) -> TaskStore | None:
        """The task store when results are on."""
        ...

    async def publish(
        self,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        session_id: str | None = None,
        priority: Priority | str | None = None,
    ) -> str:
        """``App.publish``."""
        ...

    async def publish_many(
        self,
        queue: str,
        payloads: Iterable[Any],
        *,
        task_ids: Sequence[str] | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
        session_id: str | None = None,
    ) -> list[str]:
        """``App.publish_many``."""
        ...

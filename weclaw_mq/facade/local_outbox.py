"""``App``'s local outbox methods (``weclaw_mq.outbox``): start it, add a task inside the
caller's own transaction, ask whether it holds a task. Each is one call to the publishing
engine (``publishing.engine``)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, overload

from aio_pika.abc import HeadersType

from weclaw_mq.publishing.engine import PublishingEngine

if TYPE_CHECKING:
    import sqlite3

    import psycopg
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

    from weclaw_mq.outbox import Outbox


class LocalOutbox:
    """The local outbox (``App`` inherits these methods)."""

    _engine: PublishingEngine  # set by App.__init__

    async def start_outbox(self) -> Outbox:
        """Open the outbox file and start its relay now (otherwise: at the first publish).

        Returns:
            The open outbox.

        Raises:
            OutboxUnusableError: The file is corrupt or cannot be written.
            ConfigurationError: No outbox is configured (``WECLAW_MQ_OUTBOX_PATH``).
        """
        return await self._engine.start_outbox()

    @overload
    def add_to_outbox(
        self,
        conn: psycopg.AsyncConnection[Any] | AsyncSession | AsyncConnection,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> Awaitable[str]: ...

    @overload
    def add_to_outbox(
        self,
        conn: sqlite3.Connection | psycopg.Connection[Any] | Session | Connection | Any,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> str: ...

    def add_to_outbox(
        self,
        conn: Any,
        queue: str,
        payload: Any,
        *,
        task_id: str | None = None,
        trace_id: str | None = None,
        headers: HeadersType | None = None,
    ) -> str | Awaitable[str]:
        """Add a task inside the caller's own database transaction on ``conn``.

        The relay sends it once the caller commits, and never if the caller rolls back. On
        PostgreSQL the table comes from ``weclaw-mq outbox migrate --postgres URL`` and the
        relay is ``weclaw-mq outbox relay --postgres URL`` (docs/how-to/outbox.md).

        Args:
            conn: The caller's connection, inside its transaction: a ``sqlite3`` connection
                to the outbox file; a psycopg 3 ``Connection`` or ``AsyncConnection``; an
                SQLAlchemy ``Session`` or ``Connection`` (or their async forms) on
                PostgreSQL; or Django's ``connection`` inside ``transaction.atomic()``.
            queue: The handler queue.
            payload: The task, checked like ``publish`` checks it (``prepare``).
            task_id: The task's id; default a new one.
            trace_id: The trace id (see ``publish``).
            headers: Extra AMQP headers.

        Returns:
            The task id; for an async connection, an awaitable of it.

        Raises:
            PayloadError: As in ``prepare`` (and its subclasses).
            ConfigurationError: As in ``prepare``; or ``conn`` is none of the connections
                above (a Django one outside ``transaction.atomic()`` or not on PostgreSQL).
            OutboxUnusableError: The database holds no outbox table (or file).
        """
        return self._engine.add_to_outbox(conn, queue, payload, task_id, trace_id, headers)

    async def stored_locally(self, task_id: str) -> bool:
        """Whether the outbox holds the task now, i.e. it is not on the broker yet.

        Args:
            task_id: The task's id.

        Returns:
            True while the outbox holds it; False when no outbox is configured.
        """
        return await self._engine.stored_locally(task_id)

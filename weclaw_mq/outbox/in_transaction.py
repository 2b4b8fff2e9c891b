"""One row added on the caller's own database connection, inside the caller's transaction.

``App.add_to_outbox`` takes the connection the application already writes its data with:

- ``sqlite3.Connection``: the SQLite outbox file (``outbox.store``);
- a psycopg 3 ``Connection`` or ``AsyncConnection`` (PostgreSQL, ``outbox.postgres``);
- an SQLAlchemy ``Session`` or ``Connection`` on PostgreSQL, or their ``AsyncSession`` /
  ``AsyncConnection``;
- Django's ``django.db.connection`` (or ``connections[alias]``) on PostgreSQL, inside
  ``transaction.atomic()``.

Nothing is committed here: the caller's COMMIT publishes the task (through the relay), and
the caller's rollback drops it. For an async connection the call returns an awaitable.

The libraries are told apart by their types without importing them: an application that
uses none of them loads none of them.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Awaitable
from typing import Any

from aio_pika.message import Message

from weclaw_mq.errors import ConfigurationError
from weclaw_mq.outbox.postgres import INSERT, insert_values, missing_table
from weclaw_mq.outbox.store import add_message

# SQLAlchemy's text() takes named parameters.
_NAMED_INSERT = (
    "INSERT INTO weclaw_outbox (queue, task_id, body, properties, created_at) "
    "VALUES (:queue, :task_id, :body, :properties, :created_at)"
)
_NAMES = ("queue", "task_id", "body", "properties", "created_at")


def add_in_transaction(conn: Any, queue: str, message: Message) -> Awaitable[None] | None:
    """Insert ``message`` for ``queue`` on ``conn`` (an awaitable for an async connection).

    Raises:
        ConfigurationError: ``conn`` is none of the connections above, or a Django connection
            outside ``transaction.atomic()`` or not on PostgreSQL.
        OutboxUnusableError: The database holds no outbox table (or SQLite file).
        OutboxFullError: The SQLite outbox is at its bound.
    """
    if isinstance(conn, sqlite3.Connection):
        add_message(conn, queue, message)
        return None
    values = insert_values(queue, message)
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(conn, psycopg.AsyncConnection):
        return _checked_async(conn.execute(INSERT, values))
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        _checked(lambda: conn.execute(INSERT, values))
        return None
    sqlalchemy = _sqlalchemy(conn)
    if sqlalchemy is not None:
        statement, params = sqlalchemy.text(_NAMED_INSERT), dict(zip(_NAMES, values, strict=True))
        result = _checked(lambda: conn.execute(statement, params))
        return _checked_async(result) if _is_awaitable(result) else None
    if _is_django(conn):
        _django(conn, values)
        return None
    raise ConfigurationError(
        f"add_to_outbox takes a sqlite3 connection, a psycopg 3 connection, an SQLAlchemy "
        f"session or connection, or Django's connection; got {type(conn).__name__}"
    )


def _sqlalchemy(conn: Any) -> Any:
    if not type(conn).__module__.startswith("sqlalchemy"):
        return None
    import sqlalchemy

    return sqlalchemy


def _is_django(conn: Any) -> bool:
    # A database wrapper, or ``django.db.connection`` (a proxy that forwards to one).
    return type(conn).__module__.startswith("django.") and hasattr(conn, "in_atomic_block")


def _django(conn: Any, values: tuple[Any, ...]) -> None:
    if conn.vendor != "postgresql":
        raise ConfigurationError(
            f"the transactional outbox needs PostgreSQL; Django's {conn.alias!r} database is "
            f"{conn.vendor}"
        )
    if not conn.in_atomic_block:
        raise ConfigurationError(
            "add_to_outbox(django connection) belongs inside 'with transaction.atomic():', so "
            "the task is committed with your data (outside it, the row would commit alone)"
        )
    with conn.cursor() as cursor:
        _checked(lambda: cursor.execute(INSERT, values))


def _is_awaitable(value: Any) -> bool:
    return hasattr(value, "__await__")


def _checked(call: Any) -> Any:
    try:
        return call()
    except Exception as e:
        if (unusable := _unusable(e)) is None:
            raise
        raise unusable from e


async def _checked_async(pending: Any) -> None:
    try:
        await pending
    except Exception as e:
        if (unusable := _unusable(e)) is None:
            raise
        raise unusable from e


def _unusable(e: Exception) -> Exception | None:
    # SQLAlchemy and Django wrap the driver's error (.orig, __cause__).
    for candidate in (e, getattr(e, "orig", None), e.__cause__):
        if isinstance(candidate, Exception) and (unusable := missing_table(candidate)):
            return unusable
    return None

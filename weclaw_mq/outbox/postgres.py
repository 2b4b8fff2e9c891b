"""The PostgreSQL outbox: tasks added in the application's own transaction, relayed after COMMIT.

``app.add_to_outbox(conn, queue, payload)`` inserts one row on the caller's connection inside
the caller's transaction (``in_transaction``): the task exists exactly when the caller's data
does. A rollback leaves no row, so nothing is published; a commit makes the row visible and
fires a ``NOTIFY`` (a statement trigger), so a relay listening on the channel sends it within
milliseconds instead of at its next poll.

The relay is the SQLite outbox's (``outbox.relay.Relay``, one loop for both stores): it claims
a window of rows, publishes them with confirms, and deletes each row only after its confirm.
A claim is one ``UPDATE ... WHERE seq IN (SELECT ... FOR UPDATE SKIP LOCKED)`` that sets a
lease (``claimed_until``, by the database's clock): relays running at once never take the same
row, and a relay killed mid-pass leaves its rows to the others once the lease lapses (sent
again: the worker's idempotency guard absorbs the copy). Every statement of the relay is its
own transaction (autocommit), so no lock is held while the broker confirms.

The table is created by ``weclaw-mq outbox migrate --postgres URL`` (``SCHEMA``, also shown in
docs/how-to/outbox.md); the connection's ``search_path`` decides the schema it lives in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aio_pika.message import Message

from weclaw_mq.errors import OutboxUnusableError
from weclaw_mq.outbox.store import OutboxRow, OutboxStats, row_values

if TYPE_CHECKING:
    import psycopg

    from weclaw_mq.outbox.relay import Relay

log = logging.getLogger("weclaw_mq.outbox")

# The NOTIFY channel a commit of new rows signals (one per database: a relay of another
# schema woken by it finds nothing and waits again).
CHANNEL = "weclaw_outbox"

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS weclaw_outbox (
    seq BIGSERIAL PRIMARY KEY,
    queue TEXT NOT NULL,
    task_id TEXT NOT NULL,
    body BYTEA NOT NULL,
    properties BYTEA NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    claimed_by TEXT,
    claimed_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS weclaw_outbox_task ON weclaw_outbox (task_id);
CREATE OR REPLACE FUNCTION weclaw_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', '');
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS weclaw_outbox_added ON weclaw_outbox;
CREATE TRIGGER weclaw_outbox_added AFTER INSERT ON weclaw_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION weclaw_outbox_notify();
"""

# psycopg's parameter style (%s); Django's cursors take the same.
INSERT = (
    "INSERT INTO weclaw_outbox (queue, task_id, body, properties, created_at) "
    "VALUES (%s, %s, %s, %s, %s)"
)
# The database's clock, for leases that several hosts compare.
_NOW = "extract(epoch from clock_timestamp())"


def missing_table(e: Exception) -> OutboxUnusableError | None:
    """The error that says how to create the table, when ``e`` is PostgreSQL's "no such
    relation" for it; else None."""
    if getattr(e, "sqlstate", None) == "42P01" and "weclaw_outbox" in str(e):
        return OutboxUnusableError(
            "this PostgreSQL database holds no weclaw_outbox table (in the connection's "
            "search_path): create it with 'weclaw-mq outbox migrate --postgres URL' (the SQL "
            "is in docs/how-to/outbox.md)"
        )
    return None


def insert_values(queue: str, message: Message) -> tuple[str, str, bytes, bytes, float]:
    """The INSERT's parameters for ``message`` on ``queue`` (the SQLite outbox's columns)."""
    return row_values(queue, message)


async def connect(url: str) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection to ``url``; ``OutboxUnusableError`` naming the problem (never
    the password)."""
    import psycopg

    try:
        return await psycopg.AsyncConnection.connect(url, autocommit=True)
    except psycopg.Error as e:
        raise OutboxUnusableError(
            f"cannot connect to the PostgreSQL outbox: {type(e).__name__}: {_first_line(e)}"
        ) from e


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


async def migrate(url: str) -> None:
    """Create the outbox table, its index and its NOTIFY trigger (idempotent)."""
    conn = await connect(url)
    try:
        async with conn.transaction():
            await conn.execute(SCHEMA)
    finally:
        await conn.close()


class PostgresOutbox:
    """The relay's side of the table: claim, delete, release, count (``outbox.relay``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # One statement at a time on the connection: the relay has two windows in flight.
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str) -> PostgresOutbox:
        """Connect and check the table is there; ``OutboxUnusableError`` saying why not."""
        outbox = cls(url)
        await outbox.stats()
        return outbox

    async def _execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        async with self._lock:
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                # A lost connection (a restart, a killed backend) is replaced at the next
                # statement: the relay's pass failed and is tried again.
                self._conn = conn = await connect(self.url)
            try:
                cursor = await conn.execute(sql, params)
                return await cursor.fetchall() if cursor.description is not None else []
            except psycopg.Error as e:
                if (unusable := missing_table(e)) is not None:
                    raise unusable from e
                raise

    async def claim(self, limit: int, lease_s: float) -> list[OutboxRow]:
        """Up to ``limit`` of the oldest rows nobody holds, now held by this relay."""
        found = await self._execute(
            f"UPDATE weclaw_outbox SET claimed_by = %s, claimed_until = {_NOW} + %s "
            "WHERE seq IN (SELECT seq FROM weclaw_outbox "
            f"WHERE claimed_until < {_NOW} ORDER BY seq LIMIT %s FOR UPDATE SKIP LOCKED) "
            "RETURNING seq, queue, task_id, body, properties",
            (self.owner, lease_s, limit),
        )
        rows = [
            OutboxRow(seq, queue, task_id, bytes(body), bytes(props))
            for seq, queue, task_id, body, props in found
        ]
        rows.sort(key=lambda r: r.seq)  # RETURNING promises no order
        return rows

    async def delete(self, seqs: Sequence[int]) -> None:
        """Drop confirmed rows, in one statement."""
        if seqs:
            await self._execute("DELETE FROM weclaw_outbox WHERE seq = ANY(%s)", (list(seqs),))

    async def release(self, failed: Sequence[tuple[int, str]], retry_in_s: float) -> None:
        """Give back rows whose send failed, each with its error; tried again after
        ``retry_in_s``."""
        if not failed:
            return
        await self._execute(
            f"UPDATE weclaw_outbox AS o SET claimed_by = NULL, claimed_until = {_NOW} + %s, "
            "attempts = o.attempts + 1, last_error = f.error "
            "FROM unnest(%s::bigint[], %s::text[]) AS f(seq, error) "
            "WHERE o.seq = f.seq AND o.claimed_by = %s",
            (
                retry_in_s,
                [seq for seq, _ in failed],
                [error[:500] for _, error in failed],
                self.owner,
            ),
        )

    async def find_row(self, task_id: str) -> OutboxRow | None:
        """``task_id``'s oldest row, or None if the outbox does not hold it."""
        found = await self._execute(
            "SELECT seq, queue, task_id, body, properties FROM weclaw_outbox "
            "WHERE task_id = %s ORDER BY seq LIMIT 1",
            (task_id,),
        )
        if not found:
            return None
        seq, queue, tid, body, props = found[0]
        return OutboxRow(seq, queue, tid, bytes(body), bytes(props))

    async def stats(self) -> OutboxStats:
        ((rows, size, oldest, claimed, failing, last_error, table_bytes),) = await self._execute(
            "SELECT count(*), coalesce(sum(length(body) + length(properties)), 0), "
            f"{_NOW} - min(created_at), "
            f"count(*) FILTER (WHERE claimed_by IS NOT NULL AND claimed_until > {_NOW}), "
            "count(*) FILTER (WHERE last_error IS NOT NULL), max(last_error), "
            "pg_total_relation_size('weclaw_outbox') FROM weclaw_outbox"
        )
        return OutboxStats(
            rows=rows,
            bytes=int(size),
            # The application's database bounds it, not weclaw_mq: 0 = no bound of ours.
            max_rows=0,
            max_bytes=0,
            oldest_age_s=None if oldest is None else max(0.0, float(oldest)),
            claimed=claimed,
            failing=failing,
            last_error=last_error,
            file_bytes=table_bytes,
        )

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def listen(url: str, wake: Any, stop: asyncio.Event, *, retry_s: float) -> None:
    """Call ``wake()`` at every commit of new rows (LISTEN on ``CHANNEL``) until ``stop``.

    A lost listening connection is opened again after ``retry_s``; meanwhile the relay still
    polls at its interval, so a lost notification delays a row, never loses it."""
    while not stop.is_set():
        conn = None
        try:
            conn = await connect(url)
            await conn.execute(f"LISTEN {CHANNEL}")
            wake()  # rows committed before the LISTEN: look once now
            stopping = asyncio.ensure_future(stop.wait())
            try:
                notifies = conn.notifies().__aiter__()
                while not stop.is_set():
                    nxt = asyncio.ensure_future(anext(notifies))
                    done, _ = await asyncio.wait(
                        {nxt, stopping}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if nxt not in done:
                        nxt.cancel()
                        with contextlib.suppress(BaseException):
                            await nxt
                        break
                    nxt.result()
                    wake()
            finally:
                stopping.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("outbox relay: LISTEN %s lost (%s); polling until it is back", CHANNEL, e)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        if not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), retry_s)


async def run_relay(relay: Relay, url: str, stop: asyncio.Event) -> None:
    """``relay.run(stop)`` on the PostgreSQL outbox at ``url``, woken by each COMMIT of new
    rows (``listen``) rather than only at its poll interval."""
    listener = asyncio.create_task(
        listen(url, relay.wake, stop, retry_s=relay.settings.outbox_relay_interval_s)
    )
    try:
        await relay.run(stop)
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener

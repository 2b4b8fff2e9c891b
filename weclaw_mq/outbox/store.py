"""The outbox file: a SQLite table of messages the broker has not confirmed yet.

One row is exactly what ``Publisher.publish`` would have sent: the queue (routing key on the
default exchange), the body bytes, and the AMQP basic properties as pamqp marshals them
(message id = task id, content type, delivery mode, timestamp, headers, and whatever else
the message carries). The relay sends those bytes back unchanged, so a relayed message is
byte-identical to the one publish built.

Durability: WAL, ``synchronous=FULL`` (a commit survives a power cut, not only a crash of
the process), every write in its own ``BEGIN IMMEDIATE`` transaction. The bound (rows and
bytes) is enforced by a trigger inside the file, so a user's own transaction writing rows
(``add_message`` on their connection) is bounded the same way, atomically with its insert.

Claims: a relay takes rows with one ``UPDATE ... RETURNING`` inside ``BEGIN IMMEDIATE``,
setting ``claimed_by``/``claimed_until`` (a lease); another relay skips them until the lease
lapses. A row is deleted only after its confirm. A relay killed mid-pass leaves its claimed
rows to be sent again once the lease lapses: at worst a duplicate with the same task id,
which the worker's idempotency guard absorbs.

All calls here are blocking; ``Outbox`` runs them on one dedicated thread (SQLite
connections are not shared between threads) so the event loop never waits on a disk.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aio_pika.message import Message
from pamqp.commands import Basic

from weclaw_mq.errors import OutboxFullError, OutboxUnusableError

T = TypeVar("T")

SCHEMA_VERSION = 1
KIND = "weclaw_mq.outbox"
FULL_MARK = "weclaw_mq outbox full"
# How long a write waits for another process's lock (a relay, a second producer) before
# it fails; a commit takes milliseconds, so this is only reached by a stuck process.
BUSY_TIMEOUT_S = 10.0

# The tables, named so they can live inside a user's own database (transactional publish).
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS weclaw_outbox_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS weclaw_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    task_id TEXT NOT NULL,
    body BLOB NOT NULL,
    properties BLOB NOT NULL,
    created_at REAL NOT NULL,
    claimed_by TEXT,
    claimed_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS weclaw_outbox_task ON weclaw_outbox (task_id);
CREATE TABLE IF NOT EXISTS weclaw_outbox_totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    max_rows INTEGER NOT NULL,
    max_bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO weclaw_outbox_totals VALUES (0, 0, 0, 100000, 268435456);
CREATE TRIGGER IF NOT EXISTS weclaw_outbox_bound BEFORE INSERT ON weclaw_outbox
WHEN (SELECT rows + 1 > max_rows
          OR bytes + length(NEW.body) + length(NEW.properties) > max_bytes
      FROM weclaw_outbox_totals)
BEGIN SELECT RAISE(ABORT, '{FULL_MARK}'); END;
CREATE TRIGGER IF NOT EXISTS weclaw_outbox_added AFTER INSERT ON weclaw_outbox
BEGIN UPDATE weclaw_outbox_totals
      SET rows = rows + 1, bytes = bytes + length(NEW.body) + length(NEW.properties); END;
CREATE TRIGGER IF NOT EXISTS weclaw_outbox_removed AFTER DELETE ON weclaw_outbox
BEGIN UPDATE weclaw_outbox_totals
      SET rows = rows - 1, bytes = bytes - length(OLD.body) - length(OLD.properties); END;
"""

_INSERT = (
    "INSERT INTO weclaw_outbox (queue, task_id, body, properties, created_at) "
    "VALUES (?, ?, ?, ?, ?)"
)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    seq: int
    queue: str
    task_id: str
    body: bytes
    properties: bytes  # pamqp-marshalled Basic.Properties (flags first)

    def amqp_properties(self) -> Basic.Properties:
        props = Basic.Properties()
        (flags,) = struct.unpack_from(">H", self.properties)
        props.unmarshal(flags, self.properties[2:])
        return props


def row_headers(row: OutboxRow) -> dict[str, Any]:
    """The AMQP headers of ``row`` as publish built them (its deadline among them)."""
    headers = row.amqp_properties().headers
    return headers if isinstance(headers, dict) else {}


@dataclass(frozen=True, slots=True)
class OutboxStats:
    rows: int
    bytes: int
    max_rows: int
    max_bytes: int
    oldest_age_s: float | None  # None when empty
    claimed: int  # rows a relay is sending now
    failing: int  # rows whose last send failed (unroutable, nacked, ...)
    last_error: str | None
    file_bytes: int  # the database file and its WAL


class RelayStore(Protocol):
    """What the relay (``outbox.relay``) needs of an outbox: the SQLite file's ``Outbox`` and
    the PostgreSQL table's ``PostgresOutbox`` both are one."""

    async def claim(self, limit: int, lease_s: float) -> list[OutboxRow]: ...

    async def delete(self, seqs: Sequence[int]) -> None: ...

    async def release(self, failed: Sequence[tuple[int, str]], retry_in_s: float) -> None: ...

    async def stats(self) -> OutboxStats: ...

    async def close(self) -> None: ...


def row_values(queue: str, message: Message) -> tuple[str, str, bytes, bytes, float]:
    """The columns of ``message`` for ``queue``, as the relay will send them back."""
    return (
        queue,
        message.message_id or "",
        message.body,
        message.properties.marshal(),
        time.time(),
    )


def add_message(conn: sqlite3.Connection, queue: str, message: Message) -> None:
    """Insert one row on ``conn`` inside the caller's transaction (nothing is committed).

    ``OutboxFullError`` at the bound; ``OutboxUnusableError`` if the database holds no
    outbox (open it once with ``Outbox.open`` on the same file).
    """
    try:
        conn.execute(_INSERT, row_values(queue, message))
    except sqlite3.Error as e:
        raise _mapped(e, conn) from e


def _mapped(e: sqlite3.Error, conn: sqlite3.Connection) -> Exception:
    text = str(e)
    if FULL_MARK in text:
        rows, size, max_rows, max_bytes = conn.execute(
            "SELECT rows, bytes, max_rows, max_bytes FROM weclaw_outbox_totals"
        ).fetchone()
        return OutboxFullError(
            f"the outbox is full ({rows} rows, {size} bytes; bounds WECLAW_MQ_OUTBOX_MAX_ROWS="
            f"{max_rows}, WECLAW_MQ_OUTBOX_MAX_BYTES={max_bytes}): nothing was stored; is the "
            "relay running and the broker reachable? ('weclaw-mq outbox status')"
        )
    if "no such table: weclaw_outbox" in text:
        return OutboxUnusableError(
            "this database holds no weclaw_mq outbox: open it once with the App's outbox "
            "(WECLAW_MQ_OUTBOX_PATH naming this file) before adding rows"
        )
    return OutboxUnusableError(f"the outbox file failed: {type(e).__name__}: {e}")


class OutboxFile:
    """The blocking operations on one outbox file, over one connection (one thread)."""

    def __init__(
        self, path: Path, *, max_rows: int | None = None, max_bytes: int | None = None
    ) -> None:
        """Open (create) the file. With ``max_rows``/``max_bytes`` (a producer), the bounds
        of every writer of the file become these; without (a relay, a status), they stay."""
        self.path = path
        self.conn = _connect(path)
        try:
            self._prepare(max_rows, max_bytes)
        except BaseException:
            self.conn.close()
            raise

    def _prepare(self, max_rows: int | None, max_bytes: int | None) -> None:
        conn = self.conn
        what = f"the outbox file {self.path}"
        try:
            # Reading the schema is where a file that is not SQLite fails ("file is not a
            # database"); quick_check finds damaged pages in one that is.
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            (check,) = conn.execute("PRAGMA quick_check(1)").fetchone()
            if check != "ok":
                raise OutboxUnusableError(f"{what} is corrupt (quick_check: {check})")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise OutboxUnusableError(f"{what} cannot use WAL (journal mode {mode})")
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as e:
            raise OutboxUnusableError(_open_problem(what, e)) from e
        try:
            for statement in _statements(SCHEMA):
                conn.execute(statement)
            meta = dict(conn.execute("SELECT key, value FROM weclaw_outbox_meta").fetchall())
            if not meta:
                conn.executemany(
                    "INSERT INTO weclaw_outbox_meta VALUES (?, ?)",
                    [("kind", KIND), ("schema_version", str(SCHEMA_VERSION))],
                )
            elif meta.get("kind") != KIND or meta.get("schema_version") != str(SCHEMA_VERSION):
                raise OutboxUnusableError(
                    f"{what} has outbox schema {meta.get('schema_version')!r}; this weclaw_mq "
                    f"knows {SCHEMA_VERSION}: drain it with the version that wrote it"
                )
            # The bounds of the last producer that opened it apply to every writer of the file.
            if max_rows is not None:
                conn.execute("UPDATE weclaw_outbox_totals SET max_rows = ?", (max_rows,))
            if max_bytes is not None:
                conn.execute("UPDATE weclaw_outbox_totals SET max_bytes = ?", (max_bytes,))
            conn.execute("COMMIT")
        except BaseException as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(e, sqlite3.DatabaseError):
                raise OutboxUnusableError(_open_problem(what, e)) from e
            raise

    def close(self) -> None:
        self.conn.close()

    def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = work(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return out
        except sqlite3.Error as e:
            raise _mapped(e, conn) from e

    def add(self, rows: Sequence[tuple[str, Message]]) -> None:
        """All of ``rows`` in one transaction: every one is stored, or none."""
        values = [row_values(q, m) for q, m in rows]
        self._write(lambda c: c.executemany(_INSERT, values))

    def claim(self, owner: str, limit: int, lease_s: float) -> list[OutboxRow]:
        """Up to ``limit`` of the oldest rows nobody holds, now held by ``owner``."""
        now = time.time()

        def take(c: sqlite3.Connection) -> list[OutboxRow]:
            found = c.execute(
                "UPDATE weclaw_outbox SET claimed_by = ?, claimed_until = ? WHERE seq IN "
                "(SELECT seq FROM weclaw_outbox WHERE claimed_until < ? ORDER BY seq LIMIT ?) "
                "RETURNING seq, queue, task_id, body, properties",
                (owner, now + lease_s, now, limit),
            ).fetchall()
            return [OutboxRow(*r) for r in found]

        rows = self._write(take)
        rows.sort(key=lambda r: r.seq)  # RETURNING promises no order
        return rows

    def delete(self, seqs: Sequence[int]) -> None:
        """Drop confirmed rows, in one transaction."""
        if seqs:
            self._write(
                lambda c: c.executemany(
                    "DELETE FROM weclaw_outbox WHERE seq = ?", ((s,) for s in seqs)
                )
            )

    def release(self, owner: str, failed: Sequence[tuple[int, str]], retry_in_s: float) -> None:
        """Give back rows whose send failed, each with its error; tried again after
        ``retry_in_s``."""
        if not failed:
            return
        until = time.time() + retry_in_s
        self._write(
            lambda c: c.executemany(
                "UPDATE weclaw_outbox SET claimed_by = NULL, claimed_until = ?, "
                "attempts = attempts + 1, last_error = ? WHERE seq = ? AND claimed_by = ?",
                ((until, error[:500], seq, owner) for seq, error in failed),
            )
        )

    def find(self, task_id: str) -> str | None:
        """The queue of ``task_id``'s oldest row, or None if the outbox does not hold it."""
        row = self.find_row(task_id)
        return None if row is None else row.queue

    def find_row(self, task_id: str) -> OutboxRow | None:
        """``task_id``'s oldest row, or None if the outbox does not hold it."""
        row = self.conn.execute(
            "SELECT seq, queue, task_id, body, properties FROM weclaw_outbox "
            "WHERE task_id = ? ORDER BY seq LIMIT 1",
            (task_id,),
        ).fetchone()
        return None if row is None else OutboxRow(*row)

    def stats(self) -> OutboxStats:
        c = self.conn
        rows, size, max_rows, max_bytes = c.execute(
            "SELECT rows, bytes, max_rows, max_bytes FROM weclaw_outbox_totals"
        ).fetchone()
        now = time.time()
        oldest = c.execute("SELECT min(created_at) FROM weclaw_outbox").fetchone()[0]
        claimed = c.execute(
            "SELECT count(*) FROM weclaw_outbox WHERE claimed_by IS NOT NULL AND claimed_until > ?",
            (now,),
        ).fetchone()[0]
        failing, last_error = c.execute(
            "SELECT count(*), max(last_error) FROM weclaw_outbox WHERE last_error IS NOT NULL"
        ).fetchone()
        file_bytes = sum(
            p.stat().st_size
            for p in (self.path, self.path.with_name(self.path.name + "-wal"))
            if p.exists()
        )
        return OutboxStats(
            rows=rows,
            bytes=size,
            max_rows=max_rows,
            max_bytes=max_bytes,
            oldest_age_s=None if oldest is None else max(0.0, now - oldest),
            claimed=claimed,
            failing=failing,
            last_error=last_error,
            file_bytes=file_bytes,
        )


def _connect(path: Path) -> sqlite3.Connection:
    what = f"the outbox file {path}"
    if path.is_dir():
        raise OutboxUnusableError(f"{what} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise OutboxUnusableError(f"cannot create {what}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        # SQLite writes the -wal and -shm files beside it: the directory must be writable.
        raise OutboxUnusableError(f"cannot write {what}: the directory {parent} is not writable")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise OutboxUnusableError(f"cannot write {what}: permission denied")
    try:
        # Autocommit mode: every transaction here is an explicit BEGIN IMMEDIATE.
        conn = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA synchronous=FULL")
    except sqlite3.Error as e:
        raise OutboxUnusableError(_open_problem(what, e)) from e
    return conn


def _open_problem(what: str, e: sqlite3.Error) -> str:
    text = str(e)
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return f"{what} is not a readable SQLite database ({text}): corrupt, or another file"
    return f"cannot use {what}: {type(e).__name__}: {text}"


def _statements(script: str) -> list[str]:
    # Split on the statement ends outside trigger bodies ("END;" closes a trigger).
    out: list[str] = []
    current: list[str] = []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current).strip()
        if text.endswith(";") and sqlite3.complete_statement(text):
            out.append(text)
            current = []
    return out


class Outbox:
    """One outbox file for async code: every operation runs on the file's own thread."""

    def __init__(self, file: OutboxFile, executor: ThreadPoolExecutor) -> None:
        self.file = file
        self._executor = executor
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @classmethod
    async def open(
        cls, path: str | Path, *, max_rows: int | None = None, max_bytes: int | None = None
    ) -> Outbox:
        """Open (create) the file; ``OutboxUnusableError`` saying why it cannot be used."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weclaw-outbox")
        try:
            file = await asyncio.get_running_loop().run_in_executor(
                executor,
                partial(OutboxFile, Path(path), max_rows=max_rows, max_bytes=max_bytes),
            )
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(file, executor)

    @property
    def path(self) -> Path:
        return self.file.path

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def add(self, rows: Sequence[tuple[str, Message]]) -> None:
        await self._run(partial(self.file.add, rows))

    async def claim(self, limit: int, lease_s: float) -> list[OutboxRow]:
        return await self._run(partial(self.file.claim, self.owner, limit, lease_s))

    async def delete(self, seqs: Sequence[int]) -> None:
        await self._run(partial(self.file.delete, seqs))

    async def release(self, failed: Sequence[tuple[int, str]], retry_in_s: float) -> None:
        await self._run(partial(self.file.release, self.owner, failed, retry_in_s))

    async def find(self, task_id: str) -> str | None:
        return await self._run(partial(self.file.find, task_id))

    async def find_row(self, task_id: str) -> OutboxRow | None:
        return await self._run(partial(self.file.find_row, task_id))

    async def stats(self) -> OutboxStats:
        return await self._run(self.file.stats)

    async def close(self) -> None:
        try:
            await self._run(self.file.close)
        finally:
            self._executor.shutdown(wait=False)

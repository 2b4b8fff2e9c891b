"""The outbox: tasks the broker could not take (or not confirm) wait in a SQLite file, and a
relay sends them once it answers; or tasks are added in the application's own PostgreSQL
transaction (``outbox.postgres``) and relayed after COMMIT. See docs/how-to/outbox.md."""

from __future__ import annotations

from weclaw_mq.outbox.postgres import PostgresOutbox, run_relay
from weclaw_mq.outbox.relay import Relay
from weclaw_mq.outbox.store import Outbox, OutboxRow, OutboxStats, add_message

# The outbox's door: what docs/how-to/outbox.md uses (psycopg is imported only when a
# PostgreSQL outbox opens, so importing this needs no PostgreSQL driver).
__all__ = [
    "Outbox",
    "OutboxRow",
    "OutboxStats",
    "PostgresOutbox",
    "Relay",
    "add_message",
    "run_relay",
]

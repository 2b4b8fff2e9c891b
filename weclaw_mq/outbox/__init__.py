"""The outbox: tasks the broker could not take (or not confirm) wait in a SQLite file, and a
relay sends them once it answers; or tasks are added in the application's own PostgreSQL
transaction (``outbox.postgres``) and relayed after COMMIT. See docs/how-to/outbox.md."""

from __future__ import annotations

from weclaw_mq.outbox.store import Outbox, OutboxRow, OutboxStats, add_message

__all__ = ["Outbox", "OutboxRow", "OutboxStats", "add_message"]

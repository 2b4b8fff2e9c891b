"""The local outbox: tasks the broker could not take (or not confirm) wait in a SQLite file,
and a relay sends them once it answers. See docs/how-to/outbox.md."""

from __future__ import annotations

from weclaw_mq.outbox.store import Outbox, OutboxRow, OutboxStats, add_message

__all__ = ["Outbox", "OutboxRow", "OutboxStats", "add_message"]

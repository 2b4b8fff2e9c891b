"""The local outbox: tasks the broker could not take (or not confirm) wait in a SQLite file,
and a relay sends them once it answers. See the README, "When the broker is down"."""

from __future__ import annotations

from .store import Outbox, OutboxRow, OutboxStats, add_message

__all__ = ["Outbox", "OutboxRow", "OutboxStats", "add_message"]

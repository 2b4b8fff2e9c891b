"""The worker room: consume, process one delivery, settle, deadlines."""

from .consume import Worker

__all__ = ["Worker"]

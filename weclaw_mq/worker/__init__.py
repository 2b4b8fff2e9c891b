"""The worker room: consume, process one delivery, settle, deadlines."""

from weclaw_mq.worker.consume import Worker

__all__ = ["Worker"]

"""The worker: consume, admit, run the handler, end and settle every delivery, stop without loss."""

from weclaw_mq.worker.consume import Worker

__all__ = ["Worker"]

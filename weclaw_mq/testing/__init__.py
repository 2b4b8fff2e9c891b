"""A test kit for apps built on weclaw_mq: run handlers in memory with the worker's own code.

``TestBroker`` (see ``broker``) replaces RabbitMQ and Redis for one test, in milliseconds;
the pytest plugin (``pytest_plugin``, loaded by pytest once weclaw_mq is installed) gives the
fixtures ``weclaw_test_broker``, ``weclaw_rabbitmq_url`` and ``weclaw_redis_url``. The
docs/how-to/testing.md shows a whole test.
"""

from weclaw_mq.admin.dlq_message import DeadLetter
from weclaw_mq.testing.broker import MemoryPublisher, TestBroker, outcome_counts
from weclaw_mq.testing.clock import VirtualClock

__all__ = ["DeadLetter", "MemoryPublisher", "TestBroker", "VirtualClock", "outcome_counts"]

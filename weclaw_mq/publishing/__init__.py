"""The publishing room: broker connections with failover, confirmed publishing."""

from weclaw_mq.wire.connection import BrokerEndpoints
from weclaw_mq.wire.producer import Publisher

__all__ = ["BrokerEndpoints", "Publisher"]

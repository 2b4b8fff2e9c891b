"""The publishing room: broker connections with failover, confirmed publishing."""

from .connection import BrokerEndpoints
from .producer import Publisher

__all__ = ["BrokerEndpoints", "Publisher"]

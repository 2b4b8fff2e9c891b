"""The AMQP wire: connections with failover, the confirmed producer, topology, broker load."""

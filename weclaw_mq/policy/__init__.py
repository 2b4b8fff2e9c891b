"""Pure decisions, no I/O: retry, delays, signals, priority, limits, breaker, failures."""

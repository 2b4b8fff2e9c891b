"""Metrics, logs and traces, OpenTelemetry, the metrics server."""

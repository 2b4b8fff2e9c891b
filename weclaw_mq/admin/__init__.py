"""Operating a running app: DLQ triage, queue stats, dependency checks, permissions, AsyncAPI."""

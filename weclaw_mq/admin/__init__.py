"""The admin room: dead-letter triage, queue stats, health checks."""

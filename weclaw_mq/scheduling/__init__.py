"""Schedules fired exactly once per tick: the scheduler and what the CLI shows of it."""

"""Fixtures of the integration tests beyond tests/conftest.py's."""

from tests.integration.postgres_db import pg_schema

__all__ = ["pg_schema"]

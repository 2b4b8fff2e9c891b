"""A PostgreSQL schema of a test's own, for the PostgreSQL outbox's tests.

The server is the machine's (``WECLAW_TEST_POSTGRES_URL``, default the local one with
trust auth). Each test gets a schema named after it, reached through the URL's
``search_path``, and the schema is dropped (CASCADE) at teardown. A server that does not
answer fails the test with how to get one: the outbox's promise is tested on the real thing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import quote

import psycopg
import pytest

SERVER_URL = os.environ.get(
    "WECLAW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


@dataclass(frozen=True)
class PgSchema:
    """``url`` connects with ``search_path`` and ``application_name`` set to ``name`` (the
    test's own schema)."""

    name: str
    url: str

    def connect(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.url)

    def count(self, where: str = "") -> int:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM weclaw_outbox {where}").fetchone()
        assert row is not None
        return int(row[0])


def schema_url(name: str) -> str:
    sep = "&" if "?" in SERVER_URL else "?"
    # The application name tells the test's own backends apart (to end them in a drill).
    return f"{SERVER_URL}{sep}options={quote(f'-csearch_path={name}')}&application_name={name}"


@pytest.fixture
async def pg_schema(request: pytest.FixtureRequest) -> AsyncIterator[PgSchema]:
    short = request.node.name.removeprefix("test_")[:30].replace("[", "_").rstrip("]")
    name = f"t_{''.join(c if c.isalnum() else '_' for c in short)}_{uuid.uuid4().hex[:8]}".lower()
    try:
        admin = await psycopg.AsyncConnection.connect(SERVER_URL, autocommit=True)
    except psycopg.OperationalError as e:
        pytest.fail(
            f"PostgreSQL does not answer at {SERVER_URL} ({e}): start one (apt-get install -y "
            "postgresql; service postgresql start; trust auth for 127.0.0.1) or point "
            "WECLAW_TEST_POSTGRES_URL at one"
        )
    try:
        await admin.execute(f'CREATE SCHEMA "{name}"')
        yield PgSchema(name, schema_url(name))
    finally:
        # Backends a test left (a killed relay's) must not hold the schema's locks.
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND application_name = %s",
            (name,),
        )
        await admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        await admin.close()

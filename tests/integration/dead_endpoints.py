"""Endpoints that fail in the two ways a client meets: a closed port, and a peer that accepts
the connection and never answers. Both on free ports picked at run time, never a shared one."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator


def closed_port() -> int:
    """A port nothing listens on (free a moment ago; connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def closed_broker_url() -> str:
    """An AMQP URL whose port is closed: a broker that is down."""
    return f"amqp://guest:guest@127.0.0.1:{closed_port()}/"


@contextlib.asynccontextmanager
async def silent_server(accepted: asyncio.Event | None = None) -> AsyncIterator[int]:
    """A TCP server on a free port that accepts connections, reads, and never answers;
    ``accepted`` is set once a client connected."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        if accepted is not None:
            accepted.set()
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.close()
        await server.wait_closed()

"""A small asyncio TCP proxy for network drills: pass, blackhole, cut.

``pass``       bytes flow both ways.
``blackhole``  no byte moves in either direction, but every socket stays open: what a client
               sees when a switch or a firewall silently drops its packets. Bytes already read
               are held, not dropped, and flow again on ``pass_traffic()`` (TCP would
               retransmit them once the network heals). New clients are accepted and then
               hear nothing, like a SYN answered by a half-dead path.
``refuse``     every new client is closed at once, before a byte moves (counted in
               ``accepted``): a broker that is down, as its clients see it.
``cut()``      closes every client socket (and its upstream) at once.

Only for tests: one listener on 127.0.0.1 with a port chosen by the OS.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

_CHUNK = 64 * 1024


@dataclass(eq=False)  # identity, not value: links live in a set
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.close()


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.accepted = 0  # client connections ever accepted
        self.accepted_at: list[float] = []  # loop.time() of each accept
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the proxy first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def url_for(self, amqp_url: str) -> str:
        """``amqp_url`` with its host and port replaced by the proxy's."""
        parts = urlsplit(amqp_url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def mode(self) -> str:
        if self._refusing:
            return "refuse"
        return "pass" if self._flowing.is_set() else "blackhole"

    @property
    def open_links(self) -> int:
        return len(self._links)

    def blackhole(self) -> None:
        self._flowing.clear()

    def pass_traffic(self) -> None:
        self._refusing = False
        self._flowing.set()

    def refuse(self) -> None:
        self._refusing = True

    def cut(self) -> int:
        """Close every current connection; returns how many were open."""
        links = list(self._links)
        for link in links:
            link.close()
        return len(links)

    async def close(self) -> None:
        self._flowing.set()
        if self._server is not None:
            self._server.close()
        self.cut()
        for task in list(self._handlers):
            task.cancel()
        for task in list(self._handlers):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.accepted += 1
        self.accepted_at.append(asyncio.get_running_loop().time())
        link = _Link(client=writer)
        self._links.add(link)
        try:
            if self._refusing:
                return
            # The upstream is opened only while traffic flows: in a blackhole the broker must
            # not see the client either.
            await self._flowing.wait()
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError:
                return
            link.upstream = up_writer
            if writer.is_closing():  # cut while we were connecting
                return
            pumps = [
                asyncio.create_task(self._pump(reader, up_writer)),
                asyncio.create_task(self._pump(up_reader, writer)),
            ]
            link.tasks = pumps
            # Either side ending ends the link, as a real TCP relay would.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            link.close()
            self._links.discard(link)
            self._handlers.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await src.read(_CHUNK)
                if not data:
                    return
                # A chunk read just as the blackhole began is held here, not delivered.
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            return

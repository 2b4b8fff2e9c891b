"""Publishing a message whose content header no client library would write: raw AMQP frames on
a socket. Used to put a message with undecodable properties into a queue of the test broker.
"""

from __future__ import annotations

import asyncio
import struct

from pamqp import commands, frame, header
from yarl import URL

FRAME_END = b"\xce"


async def _read_frame(reader: asyncio.StreamReader) -> object:
    head = await reader.readexactly(7)
    size = struct.unpack(">I", head[3:7])[0]
    rest = await reader.readexactly(size + 1)
    _, _, decoded = frame.unmarshal(head + rest)
    return decoded


async def _expect(reader: asyncio.StreamReader, kind: type) -> object:
    while True:
        got = await _read_frame(reader)
        if isinstance(got, kind):
            return got
        if isinstance(got, (commands.Connection.Close, commands.Channel.Close)):
            raise AssertionError(f"the broker closed: {got}")


def _method(channel: int, method: object) -> bytes:
    return frame.marshal(method, channel)  # type: ignore[arg-type]


async def publish_raw(
    url: str, queue: str, *, properties: commands.Basic.Properties, body: bytes, patch: bytes
) -> None:
    """Publish ``body`` to ``queue`` with ``properties``, after replacing in the encoded content
    header the bytes ``patch[:n]`` by ``patch[n:]`` (equal halves): how a bad byte gets in."""
    parsed = URL(url)
    reader, writer = await asyncio.open_connection(parsed.host, parsed.port or 5672)
    try:
        writer.write(b"AMQP\x00\x00\x09\x01")
        await _expect(reader, commands.Connection.Start)
        auth = f"\0{parsed.user or 'guest'}\0{parsed.password or 'guest'}"
        writer.write(
            _method(
                0, commands.Connection.StartOk(mechanism="PLAIN", response=auth, locale="en_US")
            )
        )
        tune = await _expect(reader, commands.Connection.Tune)
        assert isinstance(tune, commands.Connection.Tune)
        writer.write(
            _method(
                0, commands.Connection.TuneOk(channel_max=1, frame_max=tune.frame_max, heartbeat=0)
            )
        )
        vhost = parsed.path[1:] if len(parsed.path) > 1 else "/"
        writer.write(_method(0, commands.Connection.Open(virtual_host=vhost)))
        await _expect(reader, commands.Connection.OpenOk)
        writer.write(_method(1, commands.Channel.Open()))
        await _expect(reader, commands.Channel.OpenOk)
        writer.write(_method(1, commands.Confirm.Select()))
        await _expect(reader, commands.Confirm.SelectOk)

        writer.write(_method(1, commands.Basic.Publish(exchange="", routing_key=queue)))
        content = frame.marshal(header.ContentHeader(0, len(body), properties), 1)
        half = len(patch) // 2
        assert content.count(patch[:half]) == 1, "the placeholder must occur exactly once"
        writer.write(content.replace(patch[:half], patch[half:]))
        payload = body
        writer.write(struct.pack(">BHI", 3, 1, len(payload)) + payload + FRAME_END)
        await writer.drain()
        await _expect(reader, commands.Basic.Ack)

        writer.write(
            _method(
                0,
                commands.Connection.Close(
                    reply_code=200, reply_text="done", class_id=0, method_id=0
                ),
            )
        )
        await _expect(reader, commands.Connection.CloseOk)
    finally:
        writer.close()
        await writer.wait_closed()


# A message_id that is not UTF-8: RabbitMQ stores it, pamqp refuses to decode it, and aiormq
# closes the whole connection over it. Four placeholder bytes, patched on the wire.
_PLACEHOLDER_ID = "\x01\x01\x01\x01"
BAD_ID_PATCH = b"\x04" + _PLACEHOLDER_ID.encode() + b"\x04\xff\xfe\xfd\xfc"


async def publish_undecodable(
    url: str, queue: str, body: bytes, *, headers: dict[str, str] | None = None
) -> None:
    """Publish a persistent JSON message to ``queue`` whose message_id is not UTF-8."""
    await publish_raw(
        url,
        queue,
        properties=commands.Basic.Properties(
            message_id=_PLACEHOLDER_ID,
            content_type="application/json",
            delivery_mode=2,
            headers=headers,
        ),
        body=body,
        patch=BAD_ID_PATCH,
    )

"""Messages whose properties the client library cannot decode, read without losing them.

aiormq decodes every content header with pamqp in its connection's reader task. A header pamqp
refuses (a short string that is not UTF-8, a timestamp past year 9999, an unknown field type)
kills the whole connection with ``InvalidFrameError``; the broker then returns the message,
with every other unacked one on that connection, to the head of its queue, where the next
reader meets it again. One such message would stop every look at a DLQ for good.

While ``tolerant_properties()`` is active, a header pamqp cannot decode is read instead as
properties holding only ``headers.UNDECODABLE_PROPERTIES`` (the raw property bytes, flags
included) and ``headers.UNDECODABLE_ERROR``, and ``raw_properties`` turns those bytes back into
exactly the header that came in. The switch is process-wide while any user holds it (pamqp
has no per-connection hook): the DLQ tools hold it around their own connections, and a worker
for its whole run (``Worker.run``), so another aio-pika consumer in a worker's process gets such
a message as the marker too, instead of a dead connection.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from pamqp.commands import Basic

from weclaw_mq.contract import headers as h

_decode = Basic.Properties.unmarshal
_holders = 0


def _tolerant_unmarshal(self: Basic.Properties, flags: int, data: bytes) -> None:
    try:
        _decode(self, flags, data)
    except Exception as e:  # what pamqp raises here is not one type (ValueError, OverflowError)
        for name in self.__slots__:
            setattr(self, name, None)
        self.cluster_id = ""
        self.headers = {
            # Basic's 14 property flags fit one 16-bit word (pamqp reads it as signed): that
            # word and the data are the raw property section, byte for byte.
            h.UNDECODABLE_PROPERTIES: bytearray(struct.pack(">H", flags & 0xFFFF) + data),
            h.UNDECODABLE_ERROR: f"{type(e).__name__}: {e}",
        }


@contextlib.contextmanager
def tolerant_properties() -> Iterator[None]:
    """Read undecodable content headers as raw bytes while this is held (re-entrant)."""
    global _holders
    if _holders == 0:
        Basic.Properties.unmarshal = _tolerant_unmarshal  # type: ignore[method-assign,assignment]
    _holders += 1
    try:
        yield
    finally:
        _holders -= 1
        if _holders == 0:
            Basic.Properties.unmarshal = _decode  # type: ignore[method-assign]


def undecodable(headers: object) -> bytes | None:
    """The raw property bytes when these headers stand for an undecodable header."""
    if isinstance(headers, Mapping):
        raw = headers.get(h.UNDECODABLE_PROPERTIES)
        if isinstance(raw, (bytes, bytearray)) and h.UNDECODABLE_ERROR in headers:
            return bytes(raw)
    return None


class _RawProperties(Basic.Properties):
    """Properties that encode as the exact bytes they were read from."""

    def __init__(self, raw: bytes, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._raw = raw

    def marshal(self) -> bytes:
        return self._raw


def raw_properties(raw: bytes) -> Basic.Properties:
    return _RawProperties(raw)

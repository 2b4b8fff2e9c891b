"""Checking an export record's ``amqp_properties`` before ``dlq import`` publishes anything.
Pure: no broker I/O.

An import publishes the exported property bytes unchanged (``dlq_message.record_properties``).
Bytes that are not basic properties as RabbitMQ parses them close the whole connection
(INTERNAL_ERROR) when published, after the lines before them were imported, so every line is
checked here first, by the grammar RabbitMQ reads (``rabbit_binary_parser``): the flag word,
each property its flags announce, nothing after the last one; in the headers table, only the
field types RabbitMQ knows, and no NaN or infinite float (its parser refuses those too).
Then what the broker refuses per message (a channel error, which would also stop the import
midway): an ``expiration`` that is not a number of milliseconds, a ``user_id`` that is not the
importing user.

A record exported from a message whose properties pamqp cannot decode (reason
``undecodable_properties``: a short string that is not UTF-8, a time past year 9999) passes
with this check alone; every other record's properties must also decode with pamqp, as the
worker and the DLQ tools will read them.
"""

from __future__ import annotations

import math
import struct

from pamqp.commands import Basic

# Basic's 14 property flags sit in bits 15..2 of the one flag word; bit 0 would announce a
# second word, which basic properties never have.
_UNUSED_FLAG_BITS = 0b11
# Field-value type tags RabbitMQ parses, by the size of their value in bytes; S and x carry a
# 32-bit length, F and A a 32-bit length of nested fields.
_FIXED_SIZES = {
    b"t": 1,
    b"b": 1,
    b"B": 1,
    b"s": 2,
    b"u": 2,
    b"I": 4,
    b"i": 4,
    b"l": 8,
    b"T": 8,
    b"D": 5,
    b"V": 0,
}
_FLOATS = {b"f": ">f", b"d": ">d"}
_LONG_STRINGS = (b"S", b"x")
_PROPERTY_TYPES = {
    name: getattr(Basic.Properties, f"_{name}") for name in Basic.Properties.__slots__
}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int, what: str) -> bytes:
        if self.at + n > len(self.data):
            raise ValueError(f"amqp_properties ends inside {what}")
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk

    def short_string(self, what: str) -> bytes:
        return self.take(self.take(1, what)[0], what)

    def long_length(self, what: str) -> int:
        length: int = struct.unpack(">I", self.take(4, what))[0]
        return length

    def table(self, what: str) -> None:
        length = self.long_length(what)
        end = self.at + length
        if end > len(self.data):
            raise ValueError(f"amqp_properties ends inside {what}")
        while self.at < end:
            name = self.short_string(f"a field name in {what}").decode("utf-8", "replace")
            self.field(f"field {name!r} of {what}")
        if self.at != end:
            raise ValueError(f"{what} is not as long as its length says")

    def field(self, what: str) -> None:
        tag = self.take(1, what)
        if tag in _FIXED_SIZES:
            self.take(_FIXED_SIZES[tag], what)
        elif tag in _FLOATS:
            (value,) = struct.unpack(_FLOATS[tag], self.take(struct.calcsize(_FLOATS[tag]), what))
            if not math.isfinite(value):
                raise ValueError(f"{what} is {value}, which RabbitMQ does not parse")
        elif tag in _LONG_STRINGS:
            self.take(self.long_length(what), what)
        elif tag == b"F":
            self.table(what)
        elif tag == b"A":
            length = self.long_length(what)
            end = self.at + length
            while self.at < end:
                self.field(f"an item of {what}")
            if self.at != end:
                raise ValueError(f"{what} is not as long as its length says")
        else:
            raise ValueError(f"{what} has field type {tag!r}, which RabbitMQ does not know")


def check_properties(raw: bytes, *, decodable: bool, user: str | None) -> None:
    """``ValueError`` saying what is wrong unless the broker takes ``raw`` (a flag word and
    the properties it announces) from ``user`` (None: not checked), and, when ``decodable``,
    pamqp decodes it too."""
    if len(raw) < 2:
        raise ValueError("amqp_properties is shorter than its 2 flag bytes")
    (flags,) = struct.unpack(">H", raw[:2])
    if flags & _UNUSED_FLAG_BITS:
        raise ValueError(f"amqp_properties sets flag bits no basic property has ({flags:#06x})")
    reader = _Reader(raw[2:])
    strings: dict[str, bytes] = {}
    for name, kind in _PROPERTY_TYPES.items():
        if not flags & Basic.Properties.flags[name]:
            continue
        if kind == "shortstr":
            strings[name] = reader.short_string(name)
        elif kind == "table":
            reader.table(name)
        else:
            reader.take(1 if kind == "octet" else 8, name)
    if reader.at != len(reader.data):
        extra = len(reader.data) - reader.at
        raise ValueError(f"amqp_properties has {extra} byte(s) after its last property")
    expiration = strings.get("expiration")
    if expiration is not None and not expiration.isdigit():
        raise ValueError(f"expiration {expiration!r} is not a number of milliseconds")
    user_id = strings.get("user_id")
    if user is not None and user_id is not None and user_id != user.encode():
        raise ValueError(
            f"user_id {user_id.decode('utf-8', 'replace')!r} is not the importing user "
            f"{user!r}: RabbitMQ refuses it (import as that user)"
        )
    if decodable:
        try:
            Basic.Properties().unmarshal(flags, raw[2:])
        except Exception as e:  # pamqp raises ValueError, UnicodeDecodeError, OverflowError...
            raise ValueError(f"amqp_properties does not decode ({type(e).__name__}: {e})") from e

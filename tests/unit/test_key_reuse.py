"""The body fingerprint behind ``IdempotencyConflictError`` (``weclaw_mq.state.reuse``), and
the in-memory store keeping it as Redis does (first fingerprint wins, until its TTL)."""

from __future__ import annotations

from weclaw_mq.contract.message import encode_payload
from weclaw_mq.state import MemoryTaskStore
from weclaw_mq.state.reuse import FingerprintStore, payload_fingerprint


def test_one_json_value_has_one_fingerprint_whatever_its_encoding() -> None:
    a = payload_fingerprint(b'{"text": "hi", "meta": {"x": 1, "y": [1, 2]}}')
    b = payload_fingerprint(encode_payload({"meta": {"y": [1, 2], "x": 1}, "text": "hi"}))

    assert a == b
    assert len(a) == 64 and int(a, 16) >= 0  # SHA-256, hex


def test_another_value_has_another_fingerprint() -> None:
    base = payload_fingerprint(encode_payload({"text": "hi", "n": [1, 2]}))

    assert payload_fingerprint(encode_payload({"text": "hi!", "n": [1, 2]})) != base
    assert payload_fingerprint(encode_payload({"text": "hi", "n": [2, 1]})) != base
    assert payload_fingerprint(encode_payload({"text": "hi"})) != base
    assert payload_fingerprint(b"not json") != payload_fingerprint(b"not json!")


async def test_the_memory_store_keeps_the_first_fingerprint_until_it_lapses() -> None:
    now = [0.0]
    store = MemoryTaskStore(clock=lambda: now[0])
    assert isinstance(store, FingerprintStore)

    assert await store.keep_fingerprint("q", "k", "first", 60) == "first"
    assert await store.keep_fingerprint("q", "k", "second", 60) == "first"
    assert await store.keep_fingerprint("other-q", "k", "second", 60) == "second"
    now[0] = 61.0
    assert await store.keep_fingerprint("q", "k", "third", 60) == "third"

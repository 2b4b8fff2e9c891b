"""Hypothesis strategies for hostile messages, shared by the decoder and live-worker fuzz tests.

``WECLAW_FUZZ_EXAMPLES`` scales how many examples each test draws (``make fuzz`` raises it);
runs are derandomized, so ``make test`` always draws the same examples.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from weclaw_mq.contract import headers as h

EXAMPLES = int(os.environ.get("WECLAW_FUZZ_EXAMPLES", "1"))
# The same examples on every run unless 'make fuzz' (WECLAW_FUZZ_RANDOM=1) asks for new ones.
RANDOM = os.environ.get("WECLAW_FUZZ_RANDOM") == "1"


def fuzz_settings(examples: int, *, shrink: bool = True) -> settings:
    """``shrink=False`` for live tests: shrinking reruns a failing example hundreds of times,
    each costing broker round trips and timeouts; the failing example is reported as drawn."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        phases=phases,
        max_examples=examples * EXAMPLES,
        derandomize=not RANDOM,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# Text AMQP can carry (UTF-8: no lone surrogates), control and line characters included.
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)
nasty_text = st.one_of(
    any_text,
    st.just("line one\nFORGED 2026-01-01 ERROR fake line"),
    st.just("\x00\x1b[31m\r\t"),
    st.just("x" * 10_000),
    st.just("\u2028\u202e"),
)
amqp_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    # What pamqp sends for a float; never NaN or infinite: RabbitMQ closes the connection of
    # whoever sends one, so no producer can deliver it (weclaw_mq refuses them before sending).
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    nasty_text,
    st.datetimes(
        min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.none()
    ).map(lambda d: d.replace(microsecond=0)),
)
amqp_value = st.recursive(
    amqp_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
OUR_HEADERS = [
    h.ATTEMPT,
    h.RETURNS,
    h.REQUEUED,
    h.EXPIRES_AT,
    h.TTL_MS,
    h.TRACE_ID,
    h.TRACEPARENT,
    h.FIRST_FAILURE_AT,
    h.ORIGINAL_QUEUE,
    h.DEAD_LETTER_REASON,
    h.SESSION_ID,
    h.PRIORITY,
]
header_tables = st.dictionaries(
    st.one_of(st.sampled_from(OUR_HEADERS), st.text(min_size=1, max_size=20)),
    amqp_value,
    max_size=6,
)
# A message id fits an AMQP short string (255 UTF-8 bytes).
message_ids = st.one_of(
    st.none(), nasty_text.map(lambda s: s.encode()[:255].decode(errors="ignore"))
)


def nested(depth: int) -> bytes:
    return b'{"text":' * depth + b'"x"' + b"}" * depth


def bodies(max_bytes: int) -> st.SearchStrategy[bytes]:
    """Bodies a handler of ``{"text": str}`` may be sent, most of them wrong."""
    return st.one_of(
        st.binary(max_size=200),
        st.builds(lambda t: json.dumps({"text": t}).encode(), any_text),
        st.builds(lambda t: json.dumps({"text": t}).encode("utf-16"), any_text),
        st.builds(
            lambda t: json.dumps({"text": t}, ensure_ascii=False).encode("latin-1", "replace"),
            any_text,
        ),
        st.integers(1, 5_000).map(nested),
        st.integers(max_bytes - 20, max_bytes + 50).map(lambda n: b'{"text":"' + b"y" * n + b'"}'),
        st.builds(
            lambda v: json.dumps(v).encode(),
            st.recursive(
                st.integers() | st.text(max_size=5),
                lambda i: (
                    st.lists(i, max_size=3) | st.dictionaries(st.text(max_size=5), i, max_size=3)
                ),
            ),
        ),
        st.just(b""),
        st.just(b"null"),
    )


def properties() -> st.SearchStrategy[dict[str, Any]]:
    """Message properties a foreign or hostile producer may set (none of ours included)."""
    return st.fixed_dictionaries(
        {},
        optional={
            "headers": header_tables,
            "message_id": message_ids,
            "content_type": st.one_of(
                st.sampled_from(["application/json", "text/plain", "application/octet-stream"]),
                any_text,
            ),
            "content_encoding": st.one_of(st.sampled_from(["gzip", "utf-16", "latin-1"]), any_text),
            "correlation_id": any_text,
            "type": any_text,
            "app_id": any_text,
            "timestamp": st.datetimes(
                min_value=datetime(1970, 1, 2),
                max_value=datetime(9999, 12, 30),
                timezones=st.just(UTC),
            ),
        },
    )

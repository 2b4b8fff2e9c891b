"""A task id of the caller's names one body: the same id with another body is refused.

``App.publish(queue, payload, task_id=key)`` is how a producer makes a retry safe (an HTTP
``Idempotency-Key`` becomes the task id): a second publish of the same key is a duplicate the
guard acks unrun. With another body, though, the guard would silently run only the first one.
So before sending, the store keeps the SHA-256 of the body's canonical JSON under the key
(``naming.body_key``, set only if absent, for as long as the task's record lives) and
publish compares: the same fingerprint publishes as before, another raises
``IdempotencyConflictError`` and sends nothing.

The first body keeps the key whatever became of its publish (as HTTP idempotency keys do): a
client told "nothing was accepted" retries with the same body, not a new one under the old key.

Best effort by design: only with results on (the store already written at publish); a store
that does not keep fingerprints (``FingerprintStore``), or Redis failing or slower than the
publish's wait for its "queued" record, skips the check (logged) and the publish goes on, as
before this check existed. Pure but for the protocol's implementations.
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol, runtime_checkable


def payload_fingerprint(body: bytes) -> str:
    """SHA-256 (hex) of the body as canonical JSON: sorted keys, no spaces, so two encodings
    of one JSON value (``{"a":1,"b":2}``, ``{"b": 2, "a": 1}``) share a fingerprint."""
    try:
        canonical = json.dumps(
            json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
    except (ValueError, UnicodeError, RecursionError):
        canonical = body  # publish only sends JSON; anything else is compared byte for byte
    return hashlib.sha256(canonical).hexdigest()


@runtime_checkable
class FingerprintStore(Protocol):
    """A ``TaskStore`` that also keeps body fingerprints (Redis and in-memory stores do)."""

    async def keep_fingerprint(
        self, queue: str, task_id: str, fingerprint: str, ttl_s: float
    ) -> str:
        """Keep ``fingerprint`` for (queue, task id) unless one is kept already, in one atomic step.

        Args:
            queue: The handler queue.
            task_id: The task's id.
            fingerprint: The body's fingerprint.
            ttl_s: How long to keep it, in seconds.

        Returns:
            The fingerprint kept now (``fingerprint`` when none was).
        """
        ...

"""Who signed in, and who keeps presenting a wrong token: the console's sign-in sessions and
the throttle of failed sign-ins. Kept in this console process's memory, so restarting the
console signs everyone out, and two console processes behind one balancer do not share
sessions (sign in to each, or use a Bearer token). No I/O; the clock is injectable.

- **Sessions.** Each sign-in draws a random id (256 bits) that the cookie carries, mapped
  here to the caller's identity until it expires (``Access.session_ttl_s``, 12 h by default)
  or is signed out. Nothing in the cookie is derived from the token.
- **Throttle.** Per client address, the first ``FREE_FAILURES`` wrong tokens in a row are
  answered at once; after them every further try must come twice as long as the one before
  (1 s, 2 s, 4 s ... at most ``MAX_WAIT_S``) after the last failure. A try made sooner is
  refused with 429 without its token being looked at, and counts as one more failure, so a
  client that keeps hammering stays locked out. A client's count is forgotten ``FORGET_S``
  after its last failure, and reset by a right token on the sign-in form.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

# Sessions and throttled clients kept at most: the oldest go first (bounded memory).
MAX_SESSIONS = 10_000
MAX_CLIENTS = 10_000
FREE_FAILURES = 5
MAX_WAIT_S = 300.0
FORGET_S = 3600.0

Clock = Callable[[], float]


class Sessions:
    """Signed-in sessions: a random id each, valid for ``ttl_s`` or until revoked."""

    def __init__(self, ttl_s: float, *, clock: Clock = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        # id -> (identity, expires at); insertion order is expiry order (one ttl for all).
        self._open: dict[str, tuple[str, float]] = {}

    def open(self, identity: str) -> str:
        """A new session of ``identity``: the id its cookie carries."""
        self._forget_expired()
        while len(self._open) >= MAX_SESSIONS:
            del self._open[next(iter(self._open))]
        session_id = secrets.token_urlsafe(32)
        self._open[session_id] = (identity, self._clock() + self._ttl_s)
        return session_id

    def identity_of(self, session_id: str | None) -> str | None:
        """The identity of a live session; None for a missing, unknown, expired or signed
        out one."""
        if not session_id:
            return None
        found = self._open.get(session_id)
        if found is None:
            return None
        identity, expires_at = found
        if self._clock() >= expires_at:
            del self._open[session_id]
            return None
        return identity

    def revoke(self, session_id: str | None) -> bool:
        """Sign a session out; whether it was open."""
        return session_id is not None and self._open.pop(session_id, None) is not None

    def _forget_expired(self) -> None:
        now = self._clock()
        while self._open:
            oldest = next(iter(self._open))
            if self._open[oldest][1] > now:
                return
            del self._open[oldest]


@dataclass
class _Failures:
    count: int
    last_at: float


class Throttle:
    """Failed sign-ins per client address (see the module's docstring)."""

    def __init__(self, *, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._failures: dict[str, _Failures] = {}  # in order of the last failure

    def admit(self, client: str) -> float:
        """0 when the token ``client`` presents now may be looked at; else how long it must
        still wait (and this try counts as a failure)."""
        wait_s = self.wait_s(client)
        if wait_s > 0:
            self.failed(client)
        return wait_s

    def wait_s(self, client: str) -> float:
        """How long ``client`` must still wait before its next token is looked at (0: now)."""
        failures = self._failures.get(client)
        if failures is None:
            return 0.0
        since_s = self._clock() - failures.last_at
        if since_s >= FORGET_S:
            del self._failures[client]
            return 0.0
        if failures.count < FREE_FAILURES:
            return 0.0
        delay_s = min(2.0 ** (failures.count - FREE_FAILURES), MAX_WAIT_S)
        return max(0.0, delay_s - since_s)

    def failed(self, client: str) -> None:
        """``client`` presented a wrong token."""
        failures = self._failures.pop(client, None)
        count = 1 if failures is None else failures.count + 1
        while len(self._failures) >= MAX_CLIENTS:
            del self._failures[next(iter(self._failures))]
        self._failures[client] = _Failures(count, self._clock())

    def succeeded(self, client: str) -> None:
        """``client`` signed in with the right token: its count starts again."""
        self._failures.pop(client, None)

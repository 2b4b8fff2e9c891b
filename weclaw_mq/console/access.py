"""Who may use the console and how a mutating request proves it came from the console's own
page. Pure: no I/O, so every rule is tested without a server.

- **The token.** With a token configured every request carries it: an ``Authorization:
  Bearer`` header (scripts), or the session cookie the login form sets (HttpOnly,
  SameSite=Strict; a random session id per sign-in, expiring, revoked by signing out: see
  ``sessions``). Compared in constant time. Without a token the console only serves
  a loopback address, and only to requests naming a loopback host (a page of another site
  that rebinds its DNS name to 127.0.0.1 is refused by its ``Host``).
- **CSRF.** Every mutating request carries the CSRF value the pages embed
  (``X-CSRF-Token``): an HMAC, under a secret drawn when the console starts, of the caller's
  identity (the token's fingerprint, or "anonymous"). A page of another site cannot read it.
  A browser's request must also come from the console's own origin (``Origin``, else
  ``Referer``); a request with neither is accepted only with a Bearer token, which no
  browser attaches by itself.
- **Read-only.** Every mutation is refused (and the pages show none).

The token itself is never logged nor rendered: the audit log and the pages name its
fingerprint (``fingerprint``), the first 8 hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from weclaw_mq.errors import ConfigurationError

SESSION_COOKIE = "weclaw_console"
CSRF_HEADER = "x-csrf-token"
ANONYMOUS = "anonymous"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_SESSION_TTL_S = 12 * 3600.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this
    machine only."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def fingerprint(token: str) -> str:
    """What the audit log and the pages say of a token: 8 hex digits of its SHA-256."""
    return hashlib.sha256(token.encode()).hexdigest()[:8]


def _host_of(authority: str) -> str:
    """The host of ``host[:port]`` (``[v6]:port`` too)."""
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    return authority.rpartition(":")[0] if authority.count(":") == 1 else authority


@dataclass(frozen=True)
class Access:
    """The console's access rules.

    Args:
        token: The access token, or None (then only loopback hosts are served).
        read_only: Refuse every mutation.
        secret: The key of the CSRF values; drawn per console process by default, so a
            value never outlives the console that gave it.
        session_ttl_s: How long a sign-in (its session cookie) lasts.
        secure_cookie: Mark the session cookie Secure even when the request came over plain
            HTTP: the console sits behind a proxy that terminates TLS.
    """

    token: str | None = None
    read_only: bool = False
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    secure_cookie: bool = False

    def __post_init__(self) -> None:
        if not (self.session_ttl_s > 0 and math.isfinite(self.session_ttl_s)):
            raise ConfigurationError(
                f"session_ttl_s must be a number of seconds above 0, not {self.session_ttl_s!r}"
            )

    def identity(self, presented: str | None) -> str | None:
        """The caller's identity (the token's fingerprint, or ``ANONYMOUS`` when no token is
        configured) when ``presented`` is right; None when it is missing or wrong."""
        if self.token is None:
            return ANONYMOUS
        if presented is None:
            return None
        if hmac.compare_digest(presented.encode(), self.token.encode()):
            return fingerprint(self.token)
        return None

    def host_allowed(self, host_header: str | None) -> bool:
        """Without a token, only requests naming a loopback host (the DNS-rebinding guard);
        with one, any host (the token decides)."""
        if self.token is not None:
            return True
        return host_header is not None and is_loopback(_host_of(host_header))

    def csrf_value(self, identity: str) -> str:
        """The CSRF value the pages of ``identity`` carry."""
        return hmac.new(self.secret, identity.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, identity: str, presented: str | None) -> bool:
        if not presented:
            return False
        return hmac.compare_digest(presented.encode(), self.csrf_value(identity).encode())


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool | None:
    """Whether the request came from a page of the console's own origin: True or False from
    ``Origin`` (else ``Referer``), None when the request carries neither."""
    source = origin if origin and origin != "null" else referer
    if origin == "null":  # a sandboxed or file page: never ours
        return False
    if not source:
        return None
    return host is not None and urlsplit(source).netloc.lower() == host.lower()


def mutation_refusal(
    access: Access,
    *,
    identity: str,
    csrf: str | None,
    origin: str | None,
    referer: str | None,
    host: str | None,
    bearer: bool,
) -> str | None:
    """Why a mutating request is refused (one line), or None when it may go on."""
    if access.read_only:
        return "the console is read-only (--read-only): no change is allowed"
    came_from = same_origin(origin, referer, host)
    if came_from is False or (came_from is None and not bearer):
        return "the request did not come from the console's own page (Origin/Referer)"
    if not access.csrf_ok(identity, csrf):
        return "missing or wrong CSRF value (X-CSRF-Token): reload the page"
    return None

"""Server-rendered HTML: Jinja2 templates shipped in the package (``console/templates``),
autoescaped, so every payload, result, header and error reaches the page as text (a body
holding ``<script>`` shows those characters). The pages load only the package's own script
and style (``console/static``), and the security headers forbid any other: no CDN, no
inline script.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from weclaw_mq.console.detail import pretty

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}

_env = jinja2.Environment(
    loader=jinja2.PackageLoader("weclaw_mq.console", "templates"),
    autoescape=True,  # every template, whatever its name
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _ago(value: float | None) -> str:
    if value is None:
        return "-"
    seconds = max(0.0, value)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _when(value: datetime | str | None) -> str:
    """A time as ``2026-12-03 12:52:38`` (UTC); an ISO-8601 text is read first."""
    if value is None:
        return "-"
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return str(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


_env.filters["ago"] = _ago
_env.filters["when"] = _when
_env.filters["pretty"] = pretty


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """``template`` rendered with ``context``, the caller's CSRF value and the console's
    mode, and the security headers."""
    console = request.app.state.console
    html = _env.get_template(template).render(
        csrf=getattr(request.state, "csrf", ""),
        read_only=console.access.read_only,
        signed_in=console.access.token is not None,
        app_name=console.app.name,
        path=request.url.path,
        **context,
    )
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)

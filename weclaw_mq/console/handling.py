"""What every route of the console uses: the ``Console`` (the user's App, the access rules,
the shared overview and the dead-letter previews and jobs), and reading a request and
answering an error the same way everywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from weclaw_mq.app import App
from weclaw_mq.console.access import Access
from weclaw_mq.console.dead_letters import DeadLetters
from weclaw_mq.console.guard import client_of, who
from weclaw_mq.console.overview import Overview
from weclaw_mq.console.rendering import SECURITY_HEADERS
from weclaw_mq.console.sessions import Sessions, Throttle
from weclaw_mq.errors import ConfigurationError

# How often the pages poll their fragment (ms): the overview, the tasks, a running task.
REFRESH_MS = 2000


@dataclass
class Console:
    """What the routes share: the user's App, the access rules, the cached overview, the
    dead-letter previews and jobs, the sign-in sessions and the throttle of wrong tokens."""

    app: App
    access: Access
    # Where a trace id links to: a URL with ``{trace_id}`` in it (``trace_link``).
    trace_url: str | None = None
    overview: Overview = field(init=False)
    dead_letters: DeadLetters = field(init=False)
    sessions: Sessions = field(init=False)
    throttle: Throttle = field(init=False)

    def __post_init__(self) -> None:
        self.overview = Overview(self.app)
        self.dead_letters = DeadLetters(self.app)
        self.sessions = Sessions(self.access.session_ttl_s)
        self.throttle = Throttle()


def console_of(request: Request) -> Console:
    """The console serving ``request``."""
    console: Console = request.app.state.console
    return console


def caller_of(request: Request) -> tuple[str, str]:
    """(client address, who) for the audit log."""
    return client_of(request), who(request.state.identity)


def error_response(status: int, message: str) -> JSONResponse:
    """``{"error": message}`` with ``status``."""
    return JSONResponse({"error": message}, status_code=status, headers=SECURITY_HEADERS)


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; ``ConfigurationError`` for anything else."""
    try:
        body = await request.json()
    except ValueError:
        raise ConfigurationError("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ConfigurationError("the request body is not a JSON object")
    return body

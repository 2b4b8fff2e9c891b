"""The console's Starlette application (``create_console``): its routes, the guard in front
of them (``guard.Guard``: token, host, read-only, same origin, CSRF) and its lifespan.

The pages are the same templates whether loaded whole or refreshed in part: a
``/fragments/...`` endpoint renders the part of a page its script swaps in, so there is one
rendering of each table. Routes: ``login`` (sign-in), ``task_pages`` (overview, tasks, one
task, its stream, cancel), ``dead_letter_pages`` (look, preview, run, requeue one).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib.resources import files

from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from weclaw_mq.app import App
from weclaw_mq.console import dead_letter_pages as dlq
from weclaw_mq.console import login as signing
from weclaw_mq.console import task_pages as pages
from weclaw_mq.console.access import Access
from weclaw_mq.console.detail import check_trace_url
from weclaw_mq.console.guard import Guard
from weclaw_mq.console.handling import Console


def create_console(
    app: App, access: Access | None = None, *, trace_url: str | None = None
) -> Starlette:
    """The console of ``app`` as an ASGI application (serve it with uvicorn).

    Args:
        app: The user's App: its handlers name the queues the console shows.
        access: Token, read-only; default no token and not read-only (serve it on
            127.0.0.1 only: the console then refuses any other ``Host``).
        trace_url: Where a task's trace id links to: an http(s) URL holding ``{trace_id}``
            (your tracing UI); None: no link.

    Returns:
        The Starlette application; ``app`` is closed with it.

    Raises:
        ConfigurationError: A ``trace_url`` that is not such a URL.
    """
    console = Console(
        app, access or Access(), trace_url=check_trace_url(trace_url) if trace_url else None
    )
    static = StaticFiles(directory=str(files("weclaw_mq.console") / "static"))
    routes = [
        Route("/", pages.overview_page),
        Route("/login", signing.login, methods=["GET", "POST"]),
        Route("/tasks", pages.tasks_page),
        Route("/tasks/{task_id}", pages.task_page),
        Route("/dead-letters", dlq.dead_letters_page),
        Route("/fragments/overview", pages.overview_fragment),
        Route("/fragments/tasks", pages.tasks_fragment),
        Route("/fragments/tasks/{task_id}", pages.task_fragment),
        Route("/api/overview", pages.overview_json),
        Route("/api/tasks", pages.tasks_json),
        Route("/api/tasks/{task_id}", pages.task_json),
        Route("/api/tasks/{task_id}/stream", pages.task_stream),
        Route("/api/tasks/{task_id}/cancel", pages.cancel_task, methods=["POST"]),
        Route("/api/dead-letters", dlq.dead_letters_json),
        Route("/api/dead-letters/body", dlq.dead_letter_body),
        Route("/api/dead-letters/preview", dlq.preview, methods=["POST"]),
        Route("/api/dead-letters/run", dlq.run_preview, methods=["POST"]),
        Route("/api/dead-letters/requeue-one", dlq.requeue_one, methods=["POST"]),
        Route("/api/jobs/{job_id}", dlq.job_json),
        Route("/api/session", signing.session),
        Route("/api/logout", signing.logout, methods=["POST"]),
        Mount("/static", static, name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await console.dead_letters.wait()
            await app.close()

    web = Starlette(routes=routes, lifespan=lifespan)
    web.state.console = console
    web.add_middleware(
        Guard, access=console.access, sessions=console.sessions, throttle=console.throttle
    )
    return web

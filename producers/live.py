"""Replies as they are written: the SSE endpoints of the example API and its web page.

- ``GET /tasks/{task_id}/events``: the task's stream (``App.stream``): every "attempt"
  marker and "chunk", then the "final" event, after which the response ends.
- ``GET /sessions/{session_id}/events``: the session's inbox (``App.inbox``): what is
  pending for the session, oldest first, then new events live; it never ends by itself
  (so run uvicorn with ``--timeout-graceful-shutdown``: its stop waits for open responses).
- ``POST /sessions/{session_id}/confirm`` with ``{"last_event_id": ...}``: the client has
  everything up to that id; those entries leave the inbox.
- ``GET /``: the chat page (``static/index.html``).

Both endpoints resume: the ``Last-Event-ID`` header (sent by ``EventSource`` when it
reconnects), or the ``last_event_id`` query parameter (a page that was reloaded sends the id
it kept: ``EventSource`` cannot set headers), gives exactly the events after that id.

When an inbox entry is confirmed: only once the client has shown it received it, by
resuming after it (``Last-Event-ID``) or by ``POST .../confirm``; never merely because its
frame was written. A written frame is not a received one: frames still in the socket
buffers when the connection drops (a reload, a laptop lid closing) are lost to the client,
and confirmed on write they would be gone from the inbox too.
``test_a_session_keeps_replies_until_the_client_shows_it_has_them`` (tests/integration/
test_live_api.py) drops a reader whose buffers hold unread frames; with confirm-on-write
its resumed reply misses the words of those frames (tried).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Header, HTTPException, Query, status
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, Field

from weclaw_mq import App, ConfigurationError, Inbox, StateUnavailableError, TaskState
from weclaw_mq.streaming.events import check_event_id

from .sse import EventStreamResponse, EventStreams

log = logging.getLogger("producers.live")

PAGE = Path(__file__).with_name("static") / "index.html"


class Confirm(BaseModel):
    last_event_id: str = Field(min_length=1)


LastEventHeader = Annotated[str | None, Header(alias="Last-Event-ID")]
LastEventQuery = Annotated[str | None, Query(alias="last_event_id")]


def resume_point(header: str | None, query: str | None) -> str | None:
    """The id to resume after: the header wins (``EventSource`` sets it on a reconnect, and
    it is newer than the id the page started with). 422 for an id that is no event id."""
    event_id = header or query
    if event_id is None or event_id == "":
        return None
    try:
        return check_event_id(event_id)
    except ConfigurationError as e:
        raise HTTPException(422, str(e)) from e


async def recorded_state(
    mq: App,
    task_id: str,
    queue: str | None,
    unavailable: Callable[[str], JSONResponse],
    *,
    what: str,
) -> TaskState | JSONResponse:
    """The task's record, or the API's 503 answer when the store is down (``what`` names the
    resource in it); ``404`` (raised) for a task nobody published."""
    try:
        state = await mq.status(task_id, queue=queue)
    except StateUnavailableError as e:
        log.warning("reading the record of task %s: %s", task_id, e)
        return unavailable(f"{what} are unavailable right now")
    if state is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no task {task_id!r} is known")
    return state


def add_live_routes(api: FastAPI, mq: App, unavailable: Callable[[str], JSONResponse]) -> None:
    """Attach the page and the two SSE endpoints to ``api``, reading from ``mq``.

    ``unavailable(message)`` builds the API's 503 answer (one shape for every endpoint).
    The streams' bounds and counts are ``api.state.event_streams`` (``sse.EventStreams``).
    """
    streams = EventStreams()
    api.state.event_streams = streams

    @api.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(PAGE, media_type="text/html")

    @api.get("/tasks/{task_id}/events", response_model=None)
    async def task_events(
        task_id: str,
        queue: str | None = None,
        last_event_id: LastEventHeader = None,
        last_event_id_query: LastEventQuery = None,
    ) -> EventStreamResponse | JSONResponse:
        """The task's events as Server-Sent Events, ending after its final event."""
        after = resume_point(last_event_id, last_event_id_query)
        # A typo answers 404 at once instead of a stream that waits for the task forever.
        known = await recorded_state(mq, task_id, queue, unavailable, what="task streams")
        if isinstance(known, JSONResponse):
            return known
        events = mq.stream(task_id, after, queue=queue)
        return EventStreamResponse(events, streams, end_on_final=True)

    @api.get("/sessions/{session_id}/events", response_model=None)
    async def session_events(
        session_id: str,
        last_event_id: LastEventHeader = None,
        last_event_id_query: LastEventQuery = None,
    ) -> EventStreamResponse | JSONResponse:
        """The session's inbox as Server-Sent Events, after the id the client resumes from
        (which confirms every entry up to it)."""
        after = resume_point(last_event_id, last_event_id_query)
        inbox = _inbox(session_id, after)
        if after is not None and (refused := await _confirm(inbox, after)) is not None:
            return refused
        return EventStreamResponse(aiter(inbox), streams)

    @api.post("/sessions/{session_id}/confirm", status_code=204, response_model=None)
    async def session_confirm(session_id: str, body: Confirm) -> JSONResponse | None:
        """The client has every entry up to ``last_event_id``: they leave the inbox."""
        after = resume_point(None, body.last_event_id)
        assert after is not None  # the model refuses an empty id
        return await _confirm(_inbox(session_id, None), after)

    def _inbox(session_id: str, after: str | None) -> Inbox:
        try:
            return mq.inbox(session_id, after=after)
        except ConfigurationError as e:
            raise HTTPException(422, str(e)) from e

    async def _confirm(inbox: Inbox, event_id: str) -> JSONResponse | None:
        try:
            await inbox.confirm(event_id)
        except StateUnavailableError as e:
            log.warning("confirming in the inbox of %s: %s", inbox.session_id, e)
            return unavailable("session inboxes are unavailable right now")
        return None

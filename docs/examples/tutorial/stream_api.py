"""Step 4 of the tutorial (docs/tutorial/04-streaming.md includes this file as it is): POST a
prompt, then read the reply as Server-Sent Events while the worker writes it; GET / serves
the page (stream_page.html) that does both in a browser."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Header
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel
from stream_handler import QUEUE, Prompt
from stream_handler import app as mq

PAGE = Path(__file__).with_name("stream_page.html")


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    await mq.declare()
    yield
    await mq.close()


api = FastAPI(lifespan=lifespan)


class Accepted(BaseModel):
    task_id: str


@api.post("/replies", status_code=202)
async def ask(prompt: Prompt) -> Accepted:
    return Accepted(task_id=await mq.publish(QUEUE, prompt))


async def sse(task_id: str, after: str | None) -> AsyncIterator[str]:
    # Every event the task wrote, oldest first, then live; it ends with the "final" event.
    async for event in mq.stream(task_id, after, queue=QUEUE):
        if event.kind == "chunk":
            data = json.dumps(event.data)
        elif event.kind == "final":
            data = json.dumps({"status": event.status, "result": event.result})
        else:  # "attempt": a run (re)starts, so the page drops the text of a failed one
            data = json.dumps({"attempt": event.attempt})
        yield f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n"


@api.get("/replies/{task_id}/events")
async def events(
    task_id: str, last_event_id: Annotated[str | None, Header()] = None
) -> StreamingResponse:
    # A reconnecting EventSource sends the id of the last event it saw: resume after it.
    return StreamingResponse(sse(task_id, last_event_id), media_type="text/event-stream")


@api.get("/")
async def page() -> FileResponse:
    return FileResponse(PAGE)

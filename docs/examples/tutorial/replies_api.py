"""Step 2 of the tutorial (docs/tutorial/02-fastapi.md includes this file as it is): an HTTP
API in front of step 1's handler. POST answers 202 with the task id as soon as the broker
has the task; GET reads its status and result."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from first_handler import QUEUE, Prompt
from first_handler import app as mq  # the same App: publish checks the handler's model
from pydantic import BaseModel


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    await mq.declare()  # idempotent: POST works before the first worker ever started
    yield
    await mq.close()  # its broker and Redis connections


api = FastAPI(lifespan=lifespan)


class Accepted(BaseModel):
    task_id: str


class TaskView(BaseModel):
    task_id: str
    status: str  # queued, running, retrying, succeeded, dead_lettered, ...
    attempt: int
    result: Any = None
    error: str | None = None


@api.post("/replies", status_code=202)
async def ask(prompt: Prompt) -> Accepted:
    task_id = await mq.publish(QUEUE, prompt)  # returns once the broker confirmed the task
    return Accepted(task_id=task_id)


@api.get("/replies/{task_id}")
async def reply_status(task_id: str) -> TaskView:
    state = await mq.status(task_id, queue=QUEUE)  # one Redis read, never waits
    if state is None:
        raise HTTPException(404, f"no task {task_id}")
    return TaskView(
        task_id=state.task_id,
        status=state.status.value,
        attempt=state.attempt,
        result=state.result,
        error=state.error,
    )

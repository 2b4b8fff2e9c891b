"""An HTTP front door for AI tasks: ``POST /tasks`` answers 202 + task id once RabbitMQ has it.

Run it (with a worker beside it, e.g. ``weclaw-mq worker consumers.demo:app``)::

    .venv/bin/uvicorn --factory producers.api:create_app --port 8000 --timeout-graceful-shutdown 2
    curl -s -XPOST localhost:8000/tasks -H 'content-type: application/json' \
        -d '{"text": "write a haiku about queues"}'
    curl -s localhost:8000/tasks/<task_id>
    curl -sN localhost:8000/tasks/<task_id>/events    # the reply as it is written (SSE)

and open http://localhost:8000/ for the chat page (see ``producers.live``).

An ``Idempotency-Key`` header becomes the task id: the same key with the same body answers
the first task id again (the worker runs it once); with another body, 409 and nothing is sent
(``weclaw_mq.state.reuse``, with results on). ``GET /tasks/{id}`` answers 503 with
``Retry-After`` while Redis is down, and 501 where results are turned off.

With ``WECLAW_MQ_OUTBOX_PATH`` set, a POST while the broker is down still answers 202, with
``"status": "stored_locally"``: the task waits in that SQLite file and the App's relay sends
it once the broker is back (weclaw_mq.outbox). Without it, the answer is the 503 below.

The API publishes through the demo's own ``App`` object (``consumers.demo.app``): that App
holds the handler, so ``publish`` checks each payload against the handler's pydantic model
before anything is sent, and a payload the worker would dead-letter is refused here with a
422. A separate ``App("demo")`` without the handler would only check the size. In a real
service, put the models and the handler registration in a module both sides import.

A request body over ``WECLAW_MQ_MAX_MESSAGE_BYTES`` is refused with 413 as it arrives, never
read whole (``producers.body_limit``); valid JSON that cannot be a task body (a lone
surrogate) answers 422, like a body that is no prompt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Request, Response, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from consumers.demo import Prompt
from producers.body_limit import BodyLimit
from producers.live import add_live_routes, recorded_state
from weclaw_mq import (
    App,
    BrokerUnavailableError,
    ConfirmTimeoutError,
    ConnectionLostError,
    IdempotencyConflictError,
    PayloadError,
    PayloadTooLargeError,
    PayloadValidationError,
    PublishFailedError,
    TaskStatus,
)
from weclaw_mq.contract.task_ids import TASK_ID_PATTERN

log = logging.getLogger("producers.api")

# How long a client should wait before trying again when the broker is down or refusing.
RETRY_AFTER_S = 5


class Accepted(BaseModel):
    task_id: str
    # "stored_locally" when the task went to the outbox (the broker is down); else absent.
    status: str | None = None


class TaskView(BaseModel):
    task_id: str
    queue: str
    status: str
    result: Any = None
    error: str | None = None
    attempt: int


def _unavailable(message: str, *, task_id: str | None = None) -> JSONResponse:
    detail: dict[str, Any] = {"message": message}
    if task_id is not None:
        detail["task_id"] = task_id
    return JSONResponse(
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        content={"detail": detail},
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def create_app(
    mq: App | None = None, *, queue: str | None = None, declare_on_startup: bool = True
) -> FastAPI:
    """The FastAPI app publishing to ``queue`` (default: the App's only handler queue).

    ``mq`` defaults to the demo worker's App; tests pass their own App pointed at a unique
    queue. The App is closed when the FastAPI app shuts down.
    """
    if mq is None:
        from consumers.demo import app as demo_app

        mq = demo_app
    mq_app: App = mq
    target = queue or _only_queue(mq_app)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if declare_on_startup:
            # So POST works before the first worker ever started. Best effort: an API that
            # cannot reach the broker still starts and answers 503 until the broker is back.
            try:
                await mq_app.declare()
            except BrokerUnavailableError as e:
                log.warning("could not declare queues at startup: %s", e)
        if mq_app.settings.outbox_path:
            # Opened now: a corrupt or unwritable outbox stops the API at start, and its
            # relay sends what an earlier run left there.
            await mq_app.start_outbox()
        try:
            yield
        finally:
            await mq_app.close()

    api = FastAPI(title="weclaw_mq example producer", lifespan=lifespan)
    # Refused as the body arrives: FastAPI would read all of it before any check.
    api.add_middleware(
        BodyLimit,
        max_bytes=mq_app.settings.max_message_bytes,
        what="WECLAW_MQ_MAX_MESSAGE_BYTES",
    )

    @api.post(
        "/tasks",
        status_code=status.HTTP_202_ACCEPTED,
        response_model=Accepted,
        response_model_exclude_none=True,
    )
    async def submit(
        prompt: Prompt,
        idempotency_key: Annotated[
            str | None, Header(alias="Idempotency-Key", pattern=TASK_ID_PATTERN)
        ] = None,
        session_id: Annotated[
            str | None, Header(alias="Session-Id", pattern=TASK_ID_PATTERN)
        ] = None,
    ) -> Any:
        """Publish the prompt; 202 means the broker confirmed it is stored. With a
        ``Session-Id`` header the reply also goes to that session's inbox."""
        try:
            task_id = await mq_app.publish(
                target,
                prompt,
                task_id=idempotency_key,
                session_id=session_id,
                # An Idempotency-Key names one request body (409 below), as in HTTP APIs.
                refuse_other_body=True,
            )
        except IdempotencyConflictError as e:
            # The key already names a task with another body: running only the first one
            # silently would hand this client the answer to another question.
            return JSONResponse(
                status_code=status.HTTP_409_CONFLICT,
                content={
                    "detail": {
                        "message": "this Idempotency-Key was already used with another body; "
                        "send a new body under a new key",
                        "task_id": e.task_id,
                    }
                },
            )
        # Plain numbers: Starlette renamed the 413 and 422 constants across versions.
        except PayloadTooLargeError as e:
            raise HTTPException(413, str(e)) from e
        except PayloadValidationError as e:
            raise HTTPException(422, str(e)) from e
        except PayloadError as e:
            # Valid JSON that is no task body: a lone surrogate ("\ud800"), a bad task id.
            raise HTTPException(422, str(e)) from e
        except BrokerUnavailableError as e:
            # The full reason (broker host included) goes to our log, not to the client.
            log.warning("POST /tasks refused: %s", e)
            return _unavailable("the task queue is unavailable; nothing was accepted")
        except (ConfirmTimeoutError, ConnectionLostError) as e:
            log.warning("POST /tasks outcome unknown: %s", e)
            return _unavailable(
                "the task queue did not confirm; the task may or may not be stored. Retry "
                "with the header 'Idempotency-Key: <task_id>' to keep the same task id",
                task_id=e.task_id,
            )
        except PublishFailedError as e:
            log.warning("POST /tasks refused: %s", e)
            return _unavailable("the task queue refused the task; nothing was accepted")
        if await mq_app.stored_locally(task_id):
            return Accepted(task_id=task_id, status=TaskStatus.STORED_LOCALLY.value)
        return Accepted(task_id=task_id)

    @api.get("/tasks/{task_id}", response_model=TaskView)
    async def task_status(task_id: str, queue: str | None = None) -> Any:
        """The task's latest record, or with ``?queue=`` its record in that queue (a task id
        that several pipeline stages share has one record per stage)."""
        if mq_app.results is None:
            # Not an outage (waiting will not help): this deployment keeps no statuses.
            raise HTTPException(
                status.HTTP_501_NOT_IMPLEMENTED,
                "task statuses are not kept here (WECLAW_MQ_RESULTS_ENABLED=false)",
            )
        state = await recorded_state(mq_app, task_id, queue, _unavailable, what="task statuses")
        if isinstance(state, JSONResponse):
            return state
        return TaskView(
            task_id=state.task_id,
            queue=state.queue,
            status=state.status.value,
            result=state.result,
            error=state.error,
            attempt=state.attempt,
        )

    @api.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> Response:
        # FastAPI's own answer echoes the input as UTF-8, and a lone surrogate in it ("\ud800"
        # is valid JSON) cannot be encoded: that was a 500. Escaped to ASCII, it can.
        body = json.dumps({"detail": jsonable_encoder(e.errors())}, separators=(",", ":"))
        return Response(body, status_code=422, media_type="application/json")

    add_live_routes(api, mq_app, _unavailable)
    return api


def _only_queue(mq: App) -> str:
    queues = list(mq.handlers)
    if len(queues) != 1:
        raise ValueError(
            f"App {mq.name!r} has {len(queues)} handler queues; pass queue= to create_app"
        )
    return queues[0]

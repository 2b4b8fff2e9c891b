"""A Flask front door for the shop's summaries, with the blocking API ``app.sync``.

``POST /summaries`` publishes a task and answers 202 with its id once RabbitMQ confirmed it;
``GET /summaries/<id>`` answers its status; ``GET /summaries/<id>/events`` streams the summary
(server-sent events) as the worker writes it. Any thread of any WSGI server may call
``app.sync``: the calls share one background event loop and broker connection per process,
re-made after gunicorn forks its workers. Run it beside a worker::

    flask --app producers.flask_shop:create_app run
    weclaw-mq worker producers.shop_tasks:app

tests/integration/test_web_examples.py runs it on the real broker and Redis.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from flask import Flask, Response, abort, request

from producers import shop_tasks as tasks
from weclaw_mq import App, PayloadValidationError


def create_app(weclaw: App | None = None) -> Flask:
    """The Flask app, publishing through ``weclaw`` (default: the shop's App)."""
    shop = weclaw if weclaw is not None else tasks.app
    web = Flask(__name__)

    @web.post("/summaries")
    def publish() -> tuple[dict[str, str], int]:
        try:
            task_id = shop.sync.publish(tasks.QUEUE, request.get_json(force=True))
        except PayloadValidationError as e:
            return {"error": str(e)}, 422
        return {"task_id": task_id}, 202

    @web.get("/summaries/<task_id>")
    def status(task_id: str) -> dict[str, object]:
        state = shop.sync.status(task_id, queue=tasks.QUEUE)
        if state is None:
            abort(404)
        return {"status": state.status.value, "result": state.result}

    @web.get("/summaries/<task_id>/events")
    def events(task_id: str) -> Response:
        def frames() -> Iterator[str]:
            for event in shop.sync.stream(task_id, queue=tasks.QUEUE):
                body = {"kind": event.kind, "data": event.data, "result": event.result}
                yield f"id: {event.id}\ndata: {json.dumps(body)}\n\n"

        return Response(frames(), mimetype="text/event-stream")

    return web

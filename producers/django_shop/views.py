"""POST /orders saves an order and queues its summary in one transaction; GET
/orders/<task_id>/events streams the summary (server-sent events) as the worker writes it."""

import json
from collections.abc import Iterator

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from producers import shop_tasks as tasks
from producers.django_shop.models import Order


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> HttpResponse:
    item = str(json.loads(request.body)["item"])
    with transaction.atomic():
        order = Order.objects.create(item=item)
        # One INSERT in this transaction: published after COMMIT, never after a rollback.
        order.summary_task = tasks.app.add_to_outbox(
            connection, tasks.QUEUE, {"order_id": order.pk, "item": item}
        )
        order.save(update_fields=["summary_task"])
    return JsonResponse({"order": order.pk, "task_id": order.summary_task}, status=202)


@require_GET
def summary_events(request: HttpRequest, task_id: str) -> StreamingHttpResponse:
    def frames() -> Iterator[str]:
        for event in tasks.app.sync.stream(task_id, queue=tasks.QUEUE):
            body = {"kind": event.kind, "data": event.data, "result": event.result}
            yield f"id: {event.id}\ndata: {json.dumps(body)}\n\n"

    return StreamingHttpResponse(frames(), content_type="text/event-stream")

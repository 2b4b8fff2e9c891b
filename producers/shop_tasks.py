"""The shop's summary task: its payload model and handler, on the App that the web
processes (producers.django_shop, producers.flask_shop) and the worker all import.

The web process publishes with ``app.sync`` and ``app.add_to_outbox``; the worker process runs
``weclaw-mq worker producers.shop_tasks:app``.
"""

from pydantic import BaseModel

from weclaw_mq import App, Context

QUEUE = "order-summaries"
app = App("shop")


class OrderPlaced(BaseModel):
    order_id: int
    item: str


@app.handler(QUEUE)
async def summarise(order: OrderPlaced, ctx: Context) -> str:
    # A model call would stream here; the example writes its summary in two chunks.
    await ctx.emit(f"Order {order.order_id}: ")
    await ctx.emit(f"one {order.item}.")
    return f"Order {order.order_id}: one {order.item}."

"""docs/how-to/outbox.md shows the sections of this file: a task added to the PostgreSQL
outbox inside your own transaction (psycopg 3), and the relay that sends it after COMMIT.

tests/integration/test_docs_howto_examples.py points the URL at a schema of its own, creates
the table (``weclaw-mq outbox migrate``'s SQL), runs the relay beside a worker of the real
broker, runs ``place_order()``, and sees the invoice task succeed.
"""

import asyncio

import psycopg

from weclaw_mq import App
from weclaw_mq.outbox import PostgresOutbox, Relay, run_relay

DATABASE_URL = "postgresql://shop@localhost/shop"
app = App("shop")


@app.handler("invoices")
async def invoice(order: dict[str, str]) -> dict[str, str]:
    return {"invoice": f"for {order['order']}"}


def create_tables() -> None:
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (item TEXT NOT NULL)")


def place_order() -> str:
    # --8<-- [start:example]
    with psycopg.connect(DATABASE_URL) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (item) VALUES (%s)", ("book",))
        task_id = app.add_to_outbox(conn, "invoices", {"order": "book"})
    # committed: NOTIFY wakes the relay, which publishes the task with confirm
    # --8<-- [end:example]
    return task_id


async def relay_until(stop: asyncio.Event) -> None:
    # --8<-- [start:relay]
    # What 'weclaw-mq outbox relay --postgres URL' runs, here inside your own process:
    relay = Relay(await PostgresOutbox.open(DATABASE_URL), app.settings, app.metrics)
    await run_relay(relay, DATABASE_URL, stop)
    # --8<-- [end:relay]

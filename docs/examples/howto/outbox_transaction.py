"""docs/how-to/outbox.md shows the section of this file: a task added to the outbox inside
your own SQLite transaction, in your own database file.

tests/integration/test_docs_howto_examples.py opens the outbox in a temporary ``shop.db``
(``start_outbox()`` creates its tables), runs ``place_order()``, and sees the relay send the
invoice task to a worker of the real broker once the transaction committed.
"""

import sqlite3

from weclaw_mq import App, Settings

app = App("shop", settings=Settings(outbox_path="/var/lib/shop/shop.db"))


@app.handler("invoices")
async def invoice(order: dict[str, str]) -> dict[str, str]:
    return {"invoice": f"for {order['order']}"}


def create_tables() -> None:
    conn = sqlite3.connect("/var/lib/shop/shop.db")
    with conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (item TEXT NOT NULL)")
    conn.close()


def place_order() -> None:
    # --8<-- [start:example]
    conn = sqlite3.connect("/var/lib/shop/shop.db", isolation_level=None)
    conn.execute("BEGIN")
    conn.execute("INSERT INTO orders (item) VALUES (?)", ("book",))
    app.add_to_outbox(conn, "invoices", {"order": "book"})
    conn.execute("COMMIT")  # the invoice task is sent once the relay runs
    # --8<-- [end:example]
    conn.close()

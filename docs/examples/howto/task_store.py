"""docs/reference/task-store.md shows the sections of this file: an App whose claims and
records live in a ``MemoryTaskStore``, and closing both.

The ``tests`` handler is the page's context. tests/integration/test_docs_howto_examples.py
runs a worker for ``app`` in its own process, as the page says it must, on the real broker:
the result is read from ``store``, and ``shutdown()`` closes both.
"""

# --8<-- [start:store]
from weclaw_mq import App, MemoryTaskStore

store = MemoryTaskStore()  # ttl_s, lease_s, done_ttl_s as keywords
app = App("tests", store=store)  # claims and records go to `store`
# --8<-- [end:store]


@app.handler("tests")
async def double(task: dict[str, int]) -> int:
    return task["n"] * 2


async def shutdown() -> None:
    # --8<-- [start:close]
    await app.close()
    await store.close()  # a store you pass in is yours to close
    # --8<-- [end:close]

"""docs/how-to/handlers.md shows the sections of this file: a resource opened once per worker
process and used by handlers, startup and shutdown hooks, and a middleware around every run
and publish.

tests/integration/test_docs_howto_examples.py runs a worker for ``app`` against the real broker
and Redis, and checks what the page says.
"""

# --8<-- [start:lifespan]
import logging
import time
from collections.abc import AsyncIterator

from weclaw_mq import App, Context, Middleware, Publish, Run, RunEnd

app = App("answers")


class ModelClient:  # an HTTP client with a connection pool, say
    def __init__(self, base_url: str) -> None:
        self.base_url, self.open = base_url, True

    async def complete(self, prompt: str) -> str:
        return f"an answer to {prompt!r}"

    async def aclose(self) -> None:
        self.open = False


@app.on_startup
def check_settings() -> None:  # runs first; raising here stops the worker with your line
    logging.getLogger("answers").info("starting")


@app.resource
async def model() -> AsyncIterator[ModelClient]:
    client = ModelClient("http://127.0.0.1:8080")  # opened once per worker process
    yield client
    await client.aclose()  # after the drain: no handler uses it any more


@app.handler("answers")
async def answer(task: dict[str, str], ctx: Context) -> str:
    client = ctx.use(model)  # typed: ModelClient
    return await client.complete(task["prompt"])
    # --8<-- [end:lifespan]


# --8<-- [start:middleware]
class Timing(Middleware):
    """One log line per run with its outcome and duration; a tenant header on every publish."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    async def before_run(self, run: Run) -> None:
        run.state["started"] = time.perf_counter()

    async def after_run(self, run: Run, end: RunEnd) -> None:
        took = time.perf_counter() - run.state["started"]
        self.lines.append(f"{run.queue} attempt {run.attempt}: {end.outcome} in {took:.3f} s")

    async def before_publish(self, publish: Publish) -> None:
        publish.message.headers.setdefault("x-tenant", "acme")


timing = Timing()
app.add_middleware(timing)
# --8<-- [end:middleware]

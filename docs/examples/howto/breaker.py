"""docs/how-to/breaker.md shows the section of this file.

``call_model`` is the page's context: a stand-in for the model API that answers 503 while
``UPSTREAM.down`` is true. tests/integration/test_docs_howto_examples.py takes the
upstream down and runs a worker on the real broker: after 5 failures the worker stops taking
the queue's tasks.
"""

from dataclasses import dataclass

# --8<-- [start:example]
from weclaw_mq import App, Breaker, UpstreamDown

app = App("chat")


@app.handler("chat", breaker=Breaker(failures=5, window_s=30, cooldown_s=20))
async def reply(task: dict[str, str]) -> str:
    response = await call_model(task["prompt"])
    if response.status >= 500:
        raise UpstreamDown(f"model API answered {response.status}")
    return response.text
    # --8<-- [end:example]


@dataclass
class Upstream:
    """The stand-in model API: down or up, and how many 503s it answered."""

    down: bool = False
    failures: int = 0


UPSTREAM = Upstream()


@dataclass
class ModelResponse:
    status: int
    text: str


async def call_model(prompt: str) -> ModelResponse:
    if UPSTREAM.down:
        UPSTREAM.failures += 1
        return ModelResponse(503, "Service Unavailable")
    return ModelResponse(200, f"echo: {prompt}")

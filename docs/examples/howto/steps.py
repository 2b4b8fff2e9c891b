"""docs/how-to/steps.md shows sections of this file: an agent whose model and tool calls are
memoized steps, and a streamed generation that a re-run continues where it stopped.

``search``, ``call_model`` and ``generate`` stand in for a search tool, a model client and a
streaming model client. Each counts its real calls in ``CALLS``, and breaks off once when
``BREAK_ONCE`` names it (the provider hung up), so that
tests/integration/test_docs_howto_examples.py can show the retry replaying the steps that
were recorded and the re-run continuing the stream, on the real broker and Redis.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass

CALLS: list[str] = []
BREAK_ONCE: set[str] = set()


@dataclass
class Reply:
    text: str
    input_tokens: int
    output_tokens: int


def _maybe_break(what: str) -> None:
    if what in BREAK_ONCE:
        BREAK_ONCE.discard(what)
        raise ConnectionError(f"the provider hung up during {what}")


async def search(question: str) -> list[str]:
    CALLS.append("search")
    return [f"{question} (source {i})" for i in (1, 2)]


async def call_model(model: str, prompt: str, *, idempotency_key: str) -> Reply:
    CALLS.append(f"{model} {':'.join(idempotency_key.rsplit(':', 2)[-2:])}")
    _maybe_break(prompt.split(" ", 1)[0])
    return Reply(f"{prompt[:24]}...", max(1, len(prompt) // 4), 20)


async def generate(prompt: str, *, prefix: str) -> AsyncIterator[str]:
    """A streamed reply: the words of a fixed story, from where ``prefix`` ends."""
    CALLS.append(f"generate after {len(prefix)} chars")
    words = [f"{w} " for w in f"Once upon a time {prompt} met a queue that never lost".split()]
    done = len(prefix.split())
    for i, word in enumerate(words[done:]):
        if i == 5:
            _maybe_break("generate")
        yield word


# --8<-- [start:agent]
from weclaw_mq import App, Context  # noqa: E402

app = App("agents")


@app.handler("agent")
async def agent(task: dict[str, str], ctx: Context) -> dict[str, str]:
    sources = await ctx.step("search", search, task["question"])
    notes = [await ctx.step("summarise", summarise, ctx, source) for source in sources]
    answer = await ctx.step("answer", answer_from, ctx, task["question"], notes)
    return {"answer": answer}


async def summarise(ctx: Context, source: str) -> str:
    # ctx.step_key: "<task id>:agent:summarise:<1, 2...>", the same on every attempt.
    reply = await call_model("small-1", f"Summarise {source}", idempotency_key=ctx.step_key)
    ctx.usage(input_tokens=reply.input_tokens, output_tokens=reply.output_tokens, model="small-1")
    return reply.text


async def answer_from(ctx: Context, question: str, notes: list[str]) -> str:
    prompt = f"Answer {question} from {notes}"
    reply = await call_model("big-1", prompt, idempotency_key=ctx.step_key)
    ctx.usage(input_tokens=reply.input_tokens, output_tokens=reply.output_tokens, model="big-1")
    return reply.text
    # --8<-- [end:agent]


# --8<-- [start:resume]
@app.handler("story")
async def story(task: dict[str, str], ctx: Context) -> str:
    # What an earlier run streamed before it died ([] on the first run). Read before the
    # first emit, it makes this run continue the stream instead of starting it over.
    before = "".join(await ctx.emitted())
    rest = []
    async for piece in generate(task["prompt"], prefix=before):
        await ctx.emit(piece)
        rest.append(piece)
    return before + "".join(rest)
    # --8<-- [end:resume]

"""The app tests/unit/test_asyncapi.py describes: one handler of pydantic models (payload and
result, with a context, so it may stream, and notify=True), one of plain types.

``app`` reads its settings from the environment, as a user's module does: the CLI test runs
``weclaw-mq asyncapi tests.unit.asyncapi_app:app`` in a child process with the URLs it gives.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from weclaw_mq import App, Context, RetryPolicy, Settings


class Tag(BaseModel):
    name: str = Field(min_length=1)


class Article(BaseModel):
    title: str
    words: int = Field(ge=1)
    tags: list[Tag] = []


class Summary(BaseModel):
    text: str
    tokens: int


def build_app(settings: Settings | None = None, *, notify: bool = True) -> App:
    app = App("asyncapi-test", settings=settings)

    @app.handler("summaries", retry=RetryPolicy(max_retries=2, delay_s=1), notify=notify)
    async def summarise(task: Article, ctx: Context) -> Summary:
        await ctx.emit(task.title)
        return Summary(text=task.title, tokens=task.words)

    @app.handler("scores:v2", timeout_s=30)
    async def score(task: list[int]) -> float:
        return sum(task) / max(1, len(task))

    return app


def __getattr__(name: str) -> App:
    # Built on access, so importing this module for its models reads no settings.
    if name == "app":
        return build_app()
    raise AttributeError(name)

"""docs/how-to/from-celery.md shows the sections of this file: a small Celery app (add, a
flaky fetch retried with backoff, a chain, a group with a callback, a beat entry) ported.

tests/integration/test_docs_howto_examples.py runs it on the real broker and Redis: ``add``
answers, the flaky fetch succeeds on its third attempt, the chain and the group (a chord in
Celery) end with the expected results, the schedule is registered, and a task revoked before it
runs ends ``cancelled``.
"""

from pydantic import BaseModel

from weclaw_mq import App, Context, Reject, RetryPolicy

# --8<-- [start:app]
app = App("shop")  # Celery("shop", broker=...): the URLs come from WECLAW_MQ_* settings


class Add(BaseModel):  # Celery: add(x, y). A handler takes one payload: a model of the args.
    x: int
    y: int


@app.handler("add", priorities=True)  # @celery.task; priorities: lanes for HIGH tasks
async def add(task: Add) -> int:
    return task.x + task.y


class TransientError(Exception):
    pass


# autoretry_for=(TransientError,), retry_backoff=2, max_retries=5: every exception is retried
# by the policy; raise Reject for what no retry can fix.
@app.handler("fetch", retry=RetryPolicy(max_retries=5, delay_s=0.1, multiplier=2))
async def fetch(url: str, ctx: Context) -> str:
    if not url.startswith("https://"):
        raise Reject(f"not an https URL: {url}")  # straight to the DLQ, no retry
    if ctx.attempt < 3:
        raise TransientError("the site is busy")  # attempts 1 and 2 fail, 3 succeeds
    return f"<p>the page at {url}</p>"


@app.handler("count-words")
async def count_words(page: str) -> int:  # a chain stage: the previous result is its payload
    return len(page.split())


@app.handler("total")
async def total(parts: list[int]) -> int:  # a chord's callback: every part's result, in order
    return sum(parts)


# celery beat: {"nightly-total": {"task": "add", "schedule": crontab(hour=3, minute=0)}}
app.schedule("nightly-add", queue="add", cron="0 3 * * *", payload={"x": 1, "y": 1})
# --8<-- [end:app]


async def calls() -> dict[str, object]:
    # --8<-- [start:calls]
    task_id = await app.publish("add", {"x": 2, "y": 3})  # add.delay(2, 3)
    later = await app.publish("add", {"x": 1, "y": 1}, delay_s=60, priority="high")
    # ^ apply_async(countdown=60, priority=...); a queue is the handler's name, not an option
    answer = (await app.result(task_id, timeout_s=30)).result  # AsyncResult(id).get()
    cancelled = await app.cancel(later)  # revoke(id)
    fetched = await app.result(await app.publish("fetch", "https://example.org"), timeout_s=30)
    chain_id = await app.chain(["fetch", "count-words"], "https://a.example/b/c")  # chain(...)
    words = (await app.result(chain_id, timeout_s=30)).result
    group_id = await app.group("add", [{"x": 1, "y": 2}, {"x": 3, "y": 4}], then="total")
    summed = (await app.result(group_id, timeout_s=30)).result  # chord(group(...), total.s())
    # --8<-- [end:calls]
    return {
        "answer": answer,
        "cancelled": cancelled.outcome,
        "fetched": (fetched.result, fetched.attempt),
        "words": words,
        "summed": summed,
    }

"""Middleware on the real broker and Redis (issue 28 item 3): its run hooks see every way an
attempt ends exactly once, with the outcome its message was settled as; a failing
``before_run`` is the attempt's failure; its publish hooks see every publish and its error."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import ignoring_cancels, wait_until
from weclaw_mq import (
    App,
    Context,
    Middleware,
    Outcome,
    Publish,
    Reject,
    RetryPolicy,
    Run,
    RunEnd,
    TaskStatus,
    UnroutableError,
)

FAST = RetryPolicy(max_retries=1, delay_s=0.05, multiplier=1)
# The bound of a handler's wait on the test: never reached when the code is right.
HANDLER_WAIT_S = 60.0

tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")


class Recorder(Middleware):
    """Every run hook call, as (hook, task id, attempt, outcome or None)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, Outcome | None]] = []
        self.ends: dict[tuple[str, int], RunEnd] = {}

    async def before_run(self, run: Run) -> None:
        run.state["seen"] = True
        self.calls.append(("before", run.task_id, run.attempt, None))

    async def after_run(self, run: Run, end: RunEnd) -> None:
        assert run.state["seen"] is True  # the same Run as its before_run
        self.calls.append(("after", run.task_id, run.attempt, end.outcome))
        self.ends[(run.task_id, run.attempt)] = end

    def outcomes(self, task_id: str) -> list[tuple[int, Outcome | None]]:
        return [(a, o) for hook, t, a, o in self.calls if t == task_id and hook == "after"]

    def paired(self) -> bool:
        """Each before_run has exactly one after_run, and no after_run is without one."""
        counts = Counter((hook, t, a) for hook, t, a, _ in self.calls)
        runs = {(t, a) for _, t, a, _ in self.calls}
        return all(counts[("before", *r)] == 1 and counts[("after", *r)] == 1 for r in runs)


async def test_after_run_sees_acked_retried_dead_lettered_and_cancelled_exactly_once(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    recorder = Recorder()
    app.add_middleware(recorder)
    running = asyncio.Event()

    @app.handler(qname, retry=FAST)
    async def work(task: dict[str, str], ctx: Context) -> str:
        mode = task["mode"]
        if mode == "flaky" and ctx.attempt == 1:
            raise RuntimeError("the model said busy")
        if mode == "reject":
            raise Reject("not for us")
        if mode == "cancel":
            running.set()
            await asyncio.sleep(HANDLER_WAIT_S)
        return mode

    await start_worker(app, concurrency=4)
    ok = await app.publish(qname, {"mode": "ok"})
    flaky = await app.publish(qname, {"mode": "flaky"})
    rejected = await app.publish(qname, {"mode": "reject"})
    cancelled = await app.publish(qname, {"mode": "cancel"})
    await asyncio.wait_for(running.wait(), 20)
    await app.cancel(cancelled)
    finals = {t: await app.result(t, timeout_s=30) for t in (ok, flaky, rejected, cancelled)}
    # The after_run of the last settle runs after the ack: wait for it, never for longer.
    await wait_until(lambda: len(recorder.calls) == 10, 10, "ten hook calls")

    assert {t: f.status for t, f in finals.items()} == {
        ok: TaskStatus.SUCCEEDED,
        flaky: TaskStatus.SUCCEEDED,
        rejected: TaskStatus.DEAD_LETTERED,
        cancelled: TaskStatus.CANCELLED,
    }
    assert recorder.outcomes(ok) == [(1, Outcome.ACKED)]
    assert recorder.outcomes(flaky) == [(1, Outcome.RETRIED), (2, Outcome.ACKED)]
    assert recorder.outcomes(rejected) == [(1, Outcome.DEAD_LETTERED)]
    assert recorder.outcomes(cancelled) == [(1, Outcome.CANCELLED)]
    assert recorder.paired(), recorder.calls
    assert recorder.ends[(ok, 1)].result == "ok" and recorder.ends[(ok, 1)].error is None
    assert isinstance(recorder.ends[(flaky, 1)].error, RuntimeError)
    assert isinstance(recorder.ends[(rejected, 1)].error, Reject)


async def test_a_failing_before_run_fails_the_attempt_without_calling_the_handler(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    recorder = Recorder()
    calls: list[str] = []

    class Gate(Middleware):
        async def before_run(self, run: Run) -> None:
            if run.task["user"] == "blocked":
                raise PermissionError(f"user {run.task['user']} is blocked")

    app.add_middleware(recorder)  # first: its after_run sees the gate's failure too
    app.add_middleware(Gate())

    @app.handler(qname, retry=FAST)
    async def work(task: dict[str, str]) -> str:
        calls.append(task["user"])
        return task["user"]

    await start_worker(app)
    blocked = await app.publish(qname, {"user": "blocked"})
    allowed = await app.publish(qname, {"user": "ann"})
    final = await app.result(blocked, timeout_s=30)
    assert (await app.result(allowed, timeout_s=30)).result == "ann"
    await wait_until(lambda: len(recorder.outcomes(blocked)) == 2, 10, "both attempts reported")

    assert final.status is TaskStatus.DEAD_LETTERED
    assert final.error == "PermissionError: user blocked is blocked"
    assert calls == ["ann"]  # the handler never ran for the blocked user
    assert recorder.outcomes(blocked) == [(1, Outcome.RETRIED), (2, Outcome.DEAD_LETTERED)]
    assert recorder.paired(), recorder.calls


async def test_a_context_var_set_in_before_run_reaches_async_and_plain_def_handlers(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()

    class Tenant(Middleware):
        async def before_run(self, run: Run) -> None:
            tenant.set(str(run.headers["x-tenant"]))

    app.add_middleware(Tenant())

    @app.handler(qname)
    async def in_loop(task: dict[str, int]) -> str:
        return tenant.get()

    @app.handler(f"{qname}-sync")
    def in_thread(task: dict[str, int]) -> list[str]:
        return [tenant.get(), threading.current_thread().name]

    await start_worker(app)
    a = await app.publish(qname, {"n": 1}, headers={"x-tenant": "acme"})
    b = await app.publish(f"{qname}-sync", {"n": 2}, headers={"x-tenant": "globex"})

    assert (await app.result(a, timeout_s=30)).result == "acme"
    value, thread = (await app.result(b, timeout_s=30)).result
    assert value == "globex" and thread != threading.main_thread().name


async def test_an_abandoned_handler_is_reported_once_by_the_task_that_ended_it(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(handler_cancel_grace_s=0.2)
    recorder = Recorder()
    app.add_middleware(recorder)
    release = asyncio.Event()

    @app.handler(qname, retry=RetryPolicy(max_retries=0), timeout_s=0.3)
    async def stubborn(task: dict[str, int]) -> None:
        await ignoring_cancels(release)

    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    final = await app.result(task_id, timeout_s=30)
    await wait_until(lambda: recorder.outcomes(task_id), 10, "the abandoned run reported")
    release.set()

    assert final.status is TaskStatus.DEAD_LETTERED
    assert recorder.outcomes(task_id) == [(1, Outcome.DEAD_LETTERED)]
    assert type(recorder.ends[(task_id, 1)].error).__name__ == "HandlerAbandoned"
    assert recorder.paired(), recorder.calls


async def test_publish_hooks_stamp_headers_and_see_every_publish_and_its_error(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    order: list[str] = []
    published: list[tuple[str, str, str | None]] = []

    class Stamp(Middleware):
        async def before_publish(self, publish: Publish) -> None:
            order.append("stamp.before")
            if publish.queue.endswith("-refused"):
                raise ValueError("this queue is closed to us")
            publish.message.headers["x-tenant"] = "acme"

        async def after_publish(self, publish: Publish, error: BaseException | None) -> None:
            order.append("stamp.after")
            published.append(
                (publish.queue, publish.task_id, None if error is None else type(error).__name__)
            )

    class Outer(Middleware):
        async def before_publish(self, publish: Publish) -> None:
            order.append("outer.before")

        async def after_publish(self, publish: Publish, error: BaseException | None) -> None:
            order.append("outer.after")

    app.add_middleware(Outer())
    app.add_middleware(Stamp())

    @app.handler(qname)
    async def work(task: dict[str, int], ctx: Context) -> str:
        return str(ctx.headers["x-tenant"])

    await start_worker(app)
    one = await app.publish(qname, {"n": 1})
    assert order == ["outer.before", "stamp.before", "stamp.after", "outer.after"]
    many = await app.publish_many(qname, [{"n": 2}, {"n": 3}])
    with pytest.raises(UnroutableError):
        await app.publish(f"{qname}-nowhere", {"n": 4}, task_id=f"{qname}-lost")
    with pytest.raises(ValueError, match="closed to us"):
        await app.publish(f"{qname}-refused", {"n": 5})

    assert [(await app.result(t, timeout_s=30)).result for t in [one, *many]] == ["acme"] * 3
    assert published == [
        (qname, one, None),
        (qname, many[0], None),
        (qname, many[1], None),
        (f"{qname}-nowhere", f"{qname}-lost", "UnroutableError"),
    ]  # the refused publish was never sent: no after_publish for it


async def test_a_before_run_past_the_handlers_timeout_ends_the_attempt_as_a_timeout(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    called: list[int] = []

    class Slow(Middleware):
        async def before_run(self, run: Run) -> None:
            await asyncio.sleep(3)  # past the handler's 0.5 s: the hooks share its deadline

    app.add_middleware(Slow())

    @app.handler(qname, retry=RetryPolicy(max_retries=0), timeout_s=0.5)
    async def quick(task: dict[str, int]) -> None:
        called.append(task["n"])

    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    final = await app.result(task_id, timeout_s=30)

    assert final.status is TaskStatus.DEAD_LETTERED
    assert final.error is not None and final.error.startswith("HandlerTimeout"), final.error
    assert called == []


async def test_a_cancel_request_reaches_a_before_run_that_hangs(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    entered = asyncio.Event()

    class Hanging(Middleware):
        async def before_run(self, run: Run) -> None:
            entered.set()
            await asyncio.sleep(HANDLER_WAIT_S)

    app.add_middleware(Hanging())

    @app.handler(qname, timeout_s=HANDLER_WAIT_S * 2)
    async def never_reached(task: dict[str, int]) -> None:
        raise AssertionError("the handler must not run")

    worker = await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    await asyncio.wait_for(entered.wait(), 20)
    await app.cancel(task_id)
    final = await app.result(task_id, timeout_s=20)

    assert final.status is TaskStatus.CANCELLED
    # The cancel reached the hook: its delivery ended (its slot and claim are free).
    await wait_until(lambda: worker.in_flight == 0, 20, "the delivery to end")


async def test_a_hanging_after_run_is_cut_off_and_frees_the_delivery(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weclaw_mq.worker import run_hooks

    monkeypatch.setattr(run_hooks, "AFTER_RUN_TIMEOUT_S", 0.5)
    app = make_app()
    entered = asyncio.Event()

    class Hanging(Middleware):
        async def after_run(self, run: Run, end: RunEnd) -> None:
            entered.set()
            await asyncio.sleep(HANDLER_WAIT_S)

    app.add_middleware(Hanging())

    @app.handler(qname)
    async def quick(task: dict[str, int]) -> int:
        return task["n"]

    worker = await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    final = await app.result(task_id, timeout_s=30)
    await asyncio.wait_for(entered.wait(), 20)

    assert final.status is TaskStatus.SUCCEEDED
    # The hook still sleeps; the delivery no longer waits for it.
    await wait_until(lambda: worker.in_flight == 0, 20, "the delivery to end")


async def test_an_after_run_that_always_raises_logs_one_traceback_not_one_per_task(
    make_app: Callable[..., App],
    start_worker: Callable[..., Any],
    qname: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()
    seen: list[str] = []

    class Broken(Middleware):
        async def after_run(self, run: Run, end: RunEnd) -> None:
            seen.append(run.task_id)
            raise RuntimeError("the metrics backend is down")

    app.add_middleware(Broken())

    @app.handler(qname)
    async def quick(task: dict[str, int]) -> int:
        return task["n"]

    await start_worker(app, concurrency=4)
    caplog.set_level("INFO", logger="weclaw_mq.middleware")
    ids = [await app.publish(qname, {"n": n}) for n in range(12)]
    for task_id in ids:
        assert (await app.result(task_id, timeout_s=30)).status is TaskStatus.SUCCEEDED
    await wait_until(lambda: len(seen) == 12, 20, "every after_run called")

    failures = [r for r in caplog.records if r.name == "weclaw_mq.middleware"]
    assert len([r for r in failures if r.exc_info]) == 1, [r.getMessage() for r in failures]
    assert len(failures) == 1  # the repeats fall within the minute: no line of their own


async def test_a_before_run_that_ignores_its_cancellation_is_abandoned_like_a_stuck_handler(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(handler_cancel_grace_s=0.2)
    release = asyncio.Event()

    class Stubborn(Middleware):
        async def before_run(self, run: Run) -> None:
            await ignoring_cancels(release)

    app.add_middleware(Stubborn())

    @app.handler(qname, retry=RetryPolicy(max_retries=0), timeout_s=0.3)
    async def never_reached(task: dict[str, int]) -> None:
        raise AssertionError("the handler must not run")

    worker = await start_worker(app)
    try:
        task_id = await app.publish(qname, {"n": 1})
        final = await app.result(task_id, timeout_s=30)
        await wait_until(lambda: worker.abandoned == 1, 10, "the hook abandoned")
        assert final.status is TaskStatus.DEAD_LETTERED
        assert final.error is not None and final.error.startswith("HandlerAbandoned"), final.error
    finally:
        release.set()

"""The middleware seam on the real broker and Redis: ``admit`` hooks park a task without an
attempt (``Defer``) and end like a handler past its deadline when they hang; ``around_run``
hooks nest in order around the handler's call, under its deadline, and see the run's model
calls. (The page's quota example, which dead-letters with ``Reject``, runs in
test_docs_howto_examples.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tests.conftest import ignoring_cancels, wait_until
from weclaw_mq import App, CallEnd, Context, Defer, Middleware, Reject, RetryPolicy, Run, TaskStatus

FAST = RetryPolicy(max_retries=1, delay_s=0.05, multiplier=1)
# The bound of a hook's wait on the test: never reached when the code is right.
HOOK_WAIT_S = 60.0


async def deferred_by(app: App, task_id: str, by: str) -> bool:
    state = await app.status(task_id)
    return state is not None and state.deferred is not None and state.deferred.by == by


async def test_a_deferral_asked_again_after_a_delay_spends_no_attempt(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    is_open = asyncio.Event()
    asked: list[int] = []

    class Gate(Middleware):
        async def admit(self, run: Run) -> Defer | None:
            asked.append(run.attempt)
            return None if is_open.is_set() else Defer("the gate is shut", after_s=0.2, by="gate")

    app.add_middleware(Gate())

    @app.handler(qname, retry=FAST)
    async def work(task: dict[str, int], ctx: Context) -> int:
        return ctx.attempt

    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})

    async def parked() -> bool:
        return await deferred_by(app, task_id, "gate")

    await wait_until(parked, 30, "the task parked by the gate")
    is_open.set()
    final = await app.result(task_id, timeout_s=30)
    assert final.status is TaskStatus.SUCCEEDED
    assert final.result == 1  # its deferrals spent no attempt
    assert len(asked) >= 2 and set(asked) == {1}


async def test_an_admit_hook_past_the_handlers_timeout_fails_the_attempt_as_a_timeout(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    admitted: list[int] = []
    hung = asyncio.Event()

    class Slow(Middleware):
        async def admit(self, run: Run) -> Defer | None:
            admitted.append(run.attempt)
            if run.attempt == 1:
                hung.set()
                await asyncio.sleep(HOOK_WAIT_S)  # cancelled at the handler's deadline
            return None

    app.add_middleware(Slow())
    ran: list[int] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=0), timeout_s=0.3)
    async def once(task: dict[str, int], ctx: Context) -> int:
        ran.append(ctx.attempt)
        return ctx.attempt

    @app.handler(f"{qname}-2", retry=FAST, timeout_s=0.3)
    async def twice(task: dict[str, int], ctx: Context) -> int:
        ran.append(ctx.attempt)
        return ctx.attempt

    await start_worker(app)
    failed = await app.publish(qname, {"n": 1})
    final = await app.result(failed, timeout_s=30)
    assert hung.is_set()
    assert final.status is TaskStatus.DEAD_LETTERED
    assert final.error is not None and final.error.startswith("HandlerTimeout: admit hooks")
    retried = await app.publish(f"{qname}-2", {"n": 2})
    second = await app.result(retried, timeout_s=30)
    # Its claim was freed as its first attempt failed: the retry ran at once.
    assert (second.status, second.result) == (TaskStatus.SUCCEEDED, 2)
    assert ran == [2] and admitted == [1, 1, 2]


async def test_an_admit_hook_that_ignores_its_cancellation_is_abandoned_like_a_stuck_handler(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app(handler_cancel_grace_s=0.2)
    release = asyncio.Event()
    stuck: list[str] = []

    class Stubborn(Middleware):
        async def admit(self, run: Run) -> Defer | None:
            if run.queue != qname:
                return None
            stuck.append(run.task_id)
            await ignoring_cancels(release)
            return None

    app.add_middleware(Stubborn())
    ran: list[str] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=0), timeout_s=0.3)
    async def never_reached(task: dict[str, int]) -> None:
        raise AssertionError("the handler must not run")

    @app.handler(f"{qname}-2", timeout_s=5)
    async def other(task: dict[str, int], ctx: Context) -> None:
        ran.append(ctx.task_id)

    worker = await start_worker(app)
    try:
        task_id = await app.publish(qname, {"n": 1})
        final = await app.result(task_id, timeout_s=30)
        await wait_until(lambda: worker.abandoned == 1, 10, "the hook abandoned")
        assert final.status is TaskStatus.DEAD_LETTERED
        assert final.error is not None, final
        assert final.error.startswith("HandlerAbandoned: an admit hook ran past its timeout")
        # The slot and the claim are free: the worker goes on with other tasks.
        other_id = await app.publish(f"{qname}-2", {"n": 2})
        assert (await app.result(other_id, timeout_s=30)).status is TaskStatus.SUCCEEDED
        assert ran == [other_id] and stuck == [task_id]
    finally:
        release.set()
    # The hook returned at last: its delivery's task settles nothing more, runs no handler.
    await wait_until(lambda: worker.abandoned == 0, 10, "the abandoned hook's task ended")
    assert (await app.status(task_id)).status is TaskStatus.DEAD_LETTERED  # type: ignore[union-attr]


async def test_around_run_hooks_nest_in_order_and_see_the_runs_model_calls(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()
    order: list[str] = []

    class Outer(Middleware):
        async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
            order.append("outer in")
            try:
                return await call()
            finally:
                order.append("outer out")

    class Inner(Middleware):
        async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
            order.append("inner in")
            result = await call()
            order.append("inner out")
            return result

    class Labelled(Middleware):  # innermost: its result is what the others pass on
        async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
            result = await call()
            calls = [(u.model, u.input_tokens, u.output_tokens) for u in run.usage]
            return {"answer": result, "model": run.model, "calls": calls}

    app.add_middleware(Outer())
    app.add_middleware(Inner())
    app.add_middleware(Labelled())

    @app.handler(qname)
    async def answer(task: dict[str, str], ctx: Context) -> str:
        order.append("handler")
        ctx.usage(input_tokens=10, output_tokens=5, model="small")
        ctx.usage(input_tokens=3, output_tokens=1, model="large")
        return task["q"].upper()

    await start_worker(app)
    final = await app.result(await app.publish(qname, {"q": "hi"}), timeout_s=30)
    assert final.result == {
        "answer": "HI",
        "model": None,
        "calls": [["small", 10, 5], ["large", 3, 1]],
    }
    assert order == ["outer in", "inner in", "handler", "inner out", "outer out"]


async def test_an_around_run_hook_that_hangs_ends_at_the_handlers_deadline(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    app = make_app()

    class Hangs(Middleware):
        async def around_run(self, run: Run, call: Callable[[], Awaitable[Any]]) -> Any:
            await asyncio.sleep(HOOK_WAIT_S)  # cancelled at the handler's deadline
            return await call()

    app.add_middleware(Hangs())
    ran: list[int] = []

    @app.handler(qname, retry=RetryPolicy(max_retries=0), timeout_s=0.3)
    async def work(task: dict[str, int]) -> None:
        ran.append(task["n"])

    await start_worker(app)
    final = await app.result(await app.publish(qname, {"n": 1}), timeout_s=30)
    assert final.status is TaskStatus.DEAD_LETTERED
    assert final.error == "HandlerTimeout: handler ran past its timeout of 0.3 s"
    assert ran == []


async def test_after_call_hooks_see_the_call_and_may_change_its_error_or_park_the_task(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    # One hook turns the handler's first failure into a rejection (to the DLQ now, not a
    # retry), another parks a success of the second queue once, without spending an attempt;
    # a hook that let a task through is told how its call ended, every time.
    app = make_app()
    seen: list[tuple[str, int, str | None, bool]] = []
    parked_once: list[str] = []

    class Judge(Middleware):
        async def after_call(self, run: Run, call: CallEnd) -> BaseException | Defer | None:
            error = None if call.error is None else type(call.error).__name__
            seen.append((run.queue, run.attempt, error, call.started))
            if run.queue == qname and call.error is not None:
                return Reject(f"judged: {call.error}")
            if run.queue != qname and run.task_id not in parked_once:
                parked_once.append(run.task_id)
                return Defer("judged: once more", after_s=0.05, by="judge")
            return None

    app.add_middleware(Judge())

    @app.handler(qname, retry=FAST)
    async def failing(task: dict[str, int]) -> None:
        raise RuntimeError("the answer did not parse")

    @app.handler(f"{qname}-2", retry=FAST)
    async def fine(task: dict[str, int], ctx: Context) -> int:
        return ctx.attempt

    await start_worker(app)
    failed = await app.publish(qname, {"n": 1})
    final = await app.result(failed, timeout_s=30)
    assert final.status is TaskStatus.DEAD_LETTERED  # rejected at once: FAST had a retry left
    assert final.error is not None and final.error.startswith("Reject: judged: ")
    ok = await app.publish(f"{qname}-2", {"n": 2})
    second = await app.result(ok, timeout_s=30)
    assert (second.status, second.result) == (TaskStatus.SUCCEEDED, 1)  # parked, no attempt
    assert seen == [
        (qname, 1, "RuntimeError", True),
        (f"{qname}-2", 1, None, True),
        (f"{qname}-2", 1, None, True),
    ]


async def test_an_after_call_hook_past_the_handlers_timeout_fails_the_attempt_as_a_timeout(
    make_app: Callable[..., App], start_worker: Callable[..., Any], qname: str
) -> None:
    # A hook that hangs after the call holds neither the claim nor the slot for ever: it is
    # cancelled at the handler's timeout (counted afresh) and the attempt fails with it.
    app = make_app()
    hung = asyncio.Event()

    class Slow(Middleware):
        async def after_call(self, run: Run, call: CallEnd) -> BaseException | Defer | None:
            if run.attempt == 1:
                hung.set()
                await asyncio.sleep(HOOK_WAIT_S)  # cancelled at the deadline
            return None

    app.add_middleware(Slow())

    @app.handler(qname, retry=FAST, timeout_s=0.3)
    async def work(task: dict[str, int], ctx: Context) -> int:
        return ctx.attempt

    await start_worker(app)
    task_id = await app.publish(qname, {"n": 1})
    final = await app.result(task_id, timeout_s=30)
    assert hung.is_set()
    # The first attempt failed as a timeout of the hook; its claim was freed, so the retry
    # ran at once and succeeded.
    assert (final.status, final.result) == (TaskStatus.SUCCEEDED, 2)

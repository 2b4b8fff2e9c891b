"""Starting a workflow, and cancelling one (``App.chain``, ``App.group``,
``App.cancel_workflow``).

A start writes the plan and the deadline first (``WorkflowStore.create``), then the
workflow's ``running`` record, then publishes its first tasks with confirms: the first stage,
or every part in batches of ``PUBLISH_BATCH`` (``publish_many``: one channel, pipelined
confirms). A start that fails part way (the broker went away) raises; calling it again with
the same workflow id finishes it: the plan is kept, and the tasks published before are
published again under the same task ids, which their handlers' guards absorb.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.header_values import new_trace_id
from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.contract.message import new_task_id
from weclaw_mq.contract.naming import validate_queue_name, validate_session_id
from weclaw_mq.contract.task_ids import validate_task_id
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.policy.priority import Priority
from weclaw_mq.state import Cancellation, CancelOutcome, TaskStore
from weclaw_mq.state.workflow_records import WorkflowStore, workflows_of
from weclaw_mq.workflows.hops import settle_end
from weclaw_mq.workflows.host import Host
from weclaw_mq.workflows.outstanding import cancel_outstanding
from weclaw_mq.workflows.plans import (
    CHAIN,
    GROUP,
    POLICIES,
    Plan,
    Stage,
    running_record,
    tag,
    task_id_of,
)

# Parts published per ``publish_many`` call: one channel and one batch of confirms each.
PUBLISH_BATCH = 1_000


def _stores(host: Host) -> tuple[WorkflowStore, TaskStore]:
    results = host.results
    flows = workflows_of(host.store)
    if results is None or flows is None:
        raise ConfigurationError(
            "workflows need results on (WECLAW_MQ_RESULTS_ENABLED=true) and a task store that "
            "keeps workflows (Redis, or the test kit's memory store)"
        )
    return flows, results


def _stage(stage: str | Stage) -> Stage:
    if isinstance(stage, str):
        stage = Stage(stage)
    if not isinstance(stage, Stage):
        raise ConfigurationError(f"a stage is a queue name or a Stage, not {stage!r}")
    validate_queue_name(stage.queue)
    priority = stage.priority
    if isinstance(priority, Priority):
        priority = priority.value
    elif priority is not None:
        priority = Priority(priority).value  # InvalidPriorityError for a bad one, now
    return Stage(stage.queue, priority)


def _deadline_s(host: Host, deadline_s: float | None) -> float:
    value = host.settings.workflow_deadline_s if deadline_s is None else deadline_s
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(f"deadline_s must be a positive number of seconds, got {value!r}")
    return float(value)


async def _create(host: Host, flows: WorkflowStore, results: TaskStore, plan: Plan) -> None:
    keep_ms = int(plan.deadline_ms - plan.started_ms + host.settings.result_ttl_s * 1000)
    text = plan.to_json()
    stored = await flows.create(
        plan.workflow_id,
        text,
        kind=plan.kind,
        size=plan.size,
        policy=plan.on_failure if plan.kind == GROUP else "",
        deadline_ms=plan.deadline_ms,
        keep_ms=keep_ms,
    )
    if stored != text:
        before = Plan.from_json(stored)
        if (before.kind, before.stages, before.size, before.then) != (
            plan.kind,
            plan.stages,
            plan.size,
            plan.then,
        ):
            raise ConfigurationError(
                f"workflow id {plan.workflow_id!r} was used before for another {before.kind}; "
                "pick a new id (or start the same workflow again to finish its start)"
            )


def _common(
    host: Host,
    workflow_id: str | None,
    trace_id: str | None,
    session_id: str | None,
    deadline_s: float | None,
) -> tuple[str, str, str | None, int, int]:
    wid = validate_task_id(workflow_id) if workflow_id is not None else new_task_id()
    if session_id is not None:
        validate_session_id(session_id)
    started = now_ms()
    deadline = started + int(_deadline_s(host, deadline_s) * 1000)
    return wid, trace_id or new_trace_id(), session_id, started, deadline


async def start_chain(
    host: Host,
    stages: Sequence[str | Stage],
    payload: Any,
    *,
    chain_id: str | None,
    trace_id: str | None,
    session_id: str | None,
    deadline_s: float | None,
) -> str:
    """Start a chain (``App.chain``); its id once its first stage is confirmed."""
    if isinstance(stages, str) or not stages:
        raise ConfigurationError("a chain needs a list of one or more stages")
    steps = tuple(_stage(s) for s in stages)
    flows, results = _stores(host)
    wid, trace, session, started, deadline = _common(
        host, chain_id, trace_id, session_id, deadline_s
    )
    plan = Plan(CHAIN, wid, steps, len(steps), trace, session, deadline, started)
    await _create(host, flows, results, plan)
    # Side by side: a chain that ends before its "running" record is written keeps its final
    # one (a record is written only where none exists).
    await asyncio.gather(
        results.record(running_record(plan), only_if_new=True),
        host.publish(
            steps[0].queue,
            payload,
            task_id=task_id_of(wid, 0),
            trace_id=trace,
            headers={h.WORKFLOW: tag(CHAIN, wid)},
            session_id=session,
            priority=steps[0].priority,
        ),
    )
    return wid


async def start_group(
    host: Host,
    queue: str,
    payloads: Iterable[Any],
    *,
    then: str | Stage | None,
    on_failure: str,
    group_id: str | None,
    trace_id: str | None,
    session_id: str | None,
    deadline_s: float | None,
) -> str:
    """Start a group (``App.group``); its id once every part is confirmed."""
    validate_queue_name(queue)
    if on_failure not in POLICIES:
        raise ConfigurationError(f"on_failure must be one of {POLICIES}, got {on_failure!r}")
    items = list(payloads)
    if not items:
        raise ConfigurationError("a group needs at least one part")
    callback = _stage(then) if then is not None else None
    flows, results = _stores(host)
    wid, trace, session, started, deadline = _common(
        host, group_id, trace_id, session_id, deadline_s
    )
    plan = Plan(
        GROUP,
        wid,
        (Stage(queue),),
        len(items),
        trace,
        session,
        deadline,
        started,
        then=callback,
        on_failure=on_failure,
    )
    await _create(host, flows, results, plan)
    await results.record(running_record(plan), only_if_new=True)
    host.metrics.group_parts.observe(len(items))
    for first in range(0, len(items), PUBLISH_BATCH):
        batch = items[first : first + PUBLISH_BATCH]
        await host.publish_many(
            queue,
            batch,
            task_ids=[task_id_of(wid, first + i) for i in range(len(batch))],
            trace_id=trace,
            headers={h.WORKFLOW: tag(GROUP, wid)},
            session_id=session,
        )
    return wid


async def cancel_workflow(host: Host, workflow_id: str) -> Cancellation:
    """Cancel a workflow (``App.cancel_workflow``): end it ``cancelled``, then cancel its
    tasks still to come (a chain's current and later stages; a group's parts that have not
    ended, and its callback)."""
    flows, results = _stores(host)
    progress = await flows.progress(workflow_id)
    if progress is None:
        return Cancellation(workflow_id, CancelOutcome.UNKNOWN, None)
    plan = Plan.from_json(progress.plan)
    answer = await flows.end(workflow_id, {"status": "cancelled", "by": "cancel"})
    await settle_end(host, flows, workflow_id, answer, plan)
    record = await results.get(workflow_id, queue=plan.record_queue)
    if not answer.now:
        return Cancellation(workflow_id, CancelOutcome.FINISHED, record)
    await cancel_outstanding(results, plan, progress.stage, progress.ended_parts)
    return Cancellation(workflow_id, CancelOutcome.CANCELLED, record)

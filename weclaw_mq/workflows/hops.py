"""A workflow task's end, reported to its workflow before the task is acked (the worker's
``ends.carry_out`` calls ``after_end`` on every final end of a tagged task).

Every hop is "publish with confirm, then ack the source": the next stage, or a group's
callback, is confirmed on the broker before the task that causes it is acked. A worker killed
in between leaves the source unacked; its copy comes back, finds its result stored (the
guard), and calls ``after_end`` again from the stored record: the step answers as before
(a part is counted once, by its index), and the hop is published again under the same task
id, which the next handler's guard absorbs. So a crash duplicates a publish, never loses one.

What each end does (``state.workflow_records`` for the steps):

- a chain's stage: succeeded and not the last, its result is published as the next stage's
  payload (``C.<i+1>``); any other end (the last stage's success, or a failure) ends the chain
  with it, and the chain's record says so, naming the stage;
- a group's part: counted once in the join; the part that completes it publishes the
  callback (``G.then``) with the parts' results in order; with policy "fail" a failed part
  ends the group at once (its callback never runs, and the parts still to run are
  cancelled: the next batch before its ack, the rest by the deadline sweep after it);
- a group's callback: its end is the group's.

The workflow's own record (``App.result(workflow id)``) is written from the stored outcome
by whoever meets the end, every time (a final record is never turned back, so the repeat is
a no-op), and its deadline dropped after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from weclaw_mq.contract import headers as h
from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.errors import ConfigurationError, PayloadError, WeclawMQError
from weclaw_mq.policy.failures import describe
from weclaw_mq.state import TaskState, TaskStatus
from weclaw_mq.state.workflow_records import Answer, Step, WorkflowStore, workflows_of
from weclaw_mq.workflows.host import Host
from weclaw_mq.workflows.outstanding import CANCEL_BATCH, cancel_outstanding
from weclaw_mq.workflows.plans import (
    CHAIN,
    GROUP,
    THEN,
    Plan,
    Tagged,
    callback_id,
    callback_payload,
    end_of,
    failed_by,
    read_tag,
    record_of,
    tag,
    task_id_of,
)

log = logging.getLogger("weclaw_mq.workflows")

# A part that fails its group cancels this many of the parts still to run before its ack
# (one batch: the next in the queue); the deadline sweep cancels the rest after the ack.
CANCELS_BEFORE_ACK = CANCEL_BATCH

# A publish that can never succeed (the payload does not fit the next handler's model, is
# too large, or names nothing that exists): the workflow ends, instead of a retry loop.
_PERMANENT = (PayloadError, ConfigurationError)


def tagged(headers: Mapping[str, Any], task_id: str) -> Tagged | None:
    """The task's place in a workflow, None for a task of none (one dict lookup)."""
    value = headers.get(h.WORKFLOW)
    return None if value is None else read_tag(value, task_id)


async def after_end(host: Host, place: Tagged, final: TaskState, trace_id: str) -> str | None:
    """Report the final record of a workflow's task to the workflow, before its ack.

    Returns:
        None when the task may be acked; else why not (a store or publish failure): the
        caller parks the task to try again, as for a notification that failed.
    """
    flows = workflows_of(host.store)
    if flows is None or host.results is None:
        log.error(
            "task %s belongs to workflow %s, but this worker keeps no results "
            "(WECLAW_MQ_RESULTS_ENABLED=false): the workflow is not told",
            final.task_id,
            place.workflow_id,
        )
        return None
    try:
        await _hop(host, flows, place, final, trace_id)
    except Exception as e:  # a store or broker failure: the task comes back and tries again
        why = str(e) if isinstance(e, WeclawMQError) else describe(e)
        log.error(
            "could not report task %s to workflow %s (%s)", final.task_id, place.workflow_id, why
        )
        return f"its workflow {place.workflow_id} is not told yet ({why})"
    return None


async def _hop(
    host: Host, flows: WorkflowStore, place: Tagged, final: TaskState, trace_id: str
) -> None:
    wid, end = place.workflow_id, end_of(final)
    succeeded = final.status is TaskStatus.SUCCEEDED
    if place.kind == CHAIN:
        # The chain's outcome should this stage end it: the last one's success, or a failure.
        outcome = (
            {"status": TaskStatus.SUCCEEDED.value, "result": final.result}
            if succeeded
            else failed_by("stage", place.index, end)
        )
        answer = await flows.chain_step(wid, place.index, outcome, succeeded=succeeded)
        if answer.step is Step.NEXT:
            assert answer.plan is not None
            plan = Plan.from_json(answer.plan)
            await _next_stage(host, flows, plan, place.index + 1, final.result, trace_id)
            return
    elif place.kind == GROUP:
        answer = await flows.join(
            wid,
            place.index,
            end,
            ends_group=None if succeeded else failed_by("part", place.index, end),
        )
        if answer.step is Step.JOINED:
            await _joined(host, flows, wid, trace_id)
            return
        if answer.step is Step.ENDED and _failed_by_a_part(answer):
            await _fail_fast(host, flows, wid, answer, place.index)
            return
    else:  # THEN: the callback's end is the group's
        assert place.kind == THEN
        outcome = (
            {"status": TaskStatus.SUCCEEDED.value, "result": final.result}
            if succeeded
            else failed_by("callback", -1, end)
        )
        answer = await flows.end(wid, outcome)
    if answer.step is Step.ENDED:
        await settle_end(host, flows, wid, answer)
    elif answer.step is Step.UNKNOWN:
        log.warning(
            "task %s belongs to workflow %s, which the store does not know (expired?)",
            final.task_id,
            wid,
        )


def _failed_by_a_part(answer: Answer) -> bool:
    return answer.outcome is not None and answer.outcome.get("by") == "part"


async def _fail_fast(
    host: Host, flows: WorkflowStore, wid: str, answer: Answer, index: int
) -> None:
    """A part failed the group ("fail"): the others need not run any more.

    Its record is written and its deadline made due now, before this part's ack; the deadline
    sweep (every worker's, every ``workflow_sweep_s``) then cancels every part still to run,
    after the ack, and drops the deadline: a worker that dies right after the ack leaves the
    due deadline to another's sweep. Only the next ``CANCELS_BEFORE_ACK`` parts (the queue's
    head, delivered next) are cancelled here, so the delivery costs one batch however large
    the group. A copy of the failing part (or a part that ran anyway) moves a deadline not yet
    swept only: none sends the cancels again once they were sent."""
    await settle_end(host, flows, wid, answer, sweep_soon=True)
    if not answer.now:
        return
    results = host.results
    try:
        progress = await flows.progress(wid)
        if progress is not None and results is not None:
            plan = Plan.from_json(progress.plan)
            ended = progress.ended_parts | {index}  # this part, ended but not joined
            await cancel_outstanding(results, plan, progress.stage, ended, limit=CANCELS_BEFORE_ACK)
    except Exception as e:  # the group's end stands; the sweep cancels its other parts
        log.warning("could not cancel the next parts of group %s (%s)", wid, describe(e))


async def _plan(flows: WorkflowStore, workflow_id: str) -> Plan:
    text = await flows.plan(workflow_id)
    if text is None:
        raise ConfigurationError(f"workflow {workflow_id!r} is not known to the store")
    return Plan.from_json(text)


async def _next_stage(
    host: Host, flows: WorkflowStore, plan: Plan, index: int, payload: Any, trace_id: str
) -> None:
    """Publish stage ``index`` with the result before it (the stage's end marks it out)."""
    wid, stage = plan.workflow_id, plan.stages[index]
    try:
        await host.publish(
            stage.queue,
            payload,
            task_id=task_id_of(wid, index),
            trace_id=plan.trace_id or trace_id,
            headers={h.WORKFLOW: tag(CHAIN, wid)},
            session_id=plan.session_id,
            priority=stage.priority,
        )
    except _PERMANENT as e:
        await _handoff_failed(host, flows, wid, plan.name_of(index), e)


async def _joined(host: Host, flows: WorkflowStore, wid: str, trace_id: str) -> None:
    plan = await _plan(flows, wid)
    parts = await flows.parts(wid)
    payload = callback_payload(plan, parts)
    if plan.then is None:  # no callback: the group's result is its parts'
        answer = await flows.end(wid, {"status": TaskStatus.SUCCEEDED.value, "result": payload})
        await settle_end(host, flows, wid, answer, plan)
        return
    try:
        await host.publish(
            plan.then.queue,
            payload,
            task_id=callback_id(wid),
            trace_id=plan.trace_id or trace_id,
            headers={h.WORKFLOW: tag(THEN, wid)},
            session_id=plan.session_id,
            priority=plan.then.priority,
        )
    except _PERMANENT as e:
        name = f"its callback ({plan.then.queue}, task {callback_id(wid)})"
        await _handoff_failed(host, flows, wid, name, e)
        return
    await flows.mark_published(wid, 1)
    host.metrics.group_join_seconds.observe(max(0.0, time.time() - plan.started_ms / 1000))


async def _handoff_failed(
    host: Host, flows: WorkflowStore, wid: str, what: str, error: Exception
) -> None:
    log.error("workflow %s ends: %s could not be published (%s)", wid, what, error)
    outcome = {
        "status": TaskStatus.DEAD_LETTERED.value,
        "by": "handoff",
        "what": what,
        "error": describe(error),
        "reason": "invalid_payload",
    }
    await settle_end(host, flows, wid, await flows.end(wid, outcome))


async def settle_end(
    host: Host,
    flows: WorkflowStore,
    wid: str,
    answer: Answer,
    plan: Plan | None = None,
    *,
    sweep_soon: bool = False,
) -> None:
    """Write the ended workflow's record from its stored outcome, then drop its deadline
    (``sweep_soon``: make it due now instead, for the sweep to cancel what is still to run)."""
    if answer.outcome is None:
        return
    if plan is None:
        plan = Plan.from_json(answer.plan) if answer.plan else await _plan(flows, wid)
    record = record_of(plan, answer.outcome)
    results = host.results
    assert results is not None
    deadline = flows.sweep_soon(wid, now_ms()) if sweep_soon else flows.forget_deadline(wid)
    await asyncio.gather(results.record(record), deadline)
    if answer.now:
        host.metrics.workflows_ended.labels(plan.kind, record.status.value).inc()
        log.info("workflow %s (%s) ended %s", wid, plan.kind, record.status.value)

"""Cancelling what a workflow still waits for, once it ended without it (a cancel, its
deadline, or a failed part under ``on_failure="fail"``)."""

from __future__ import annotations

import asyncio

from weclaw_mq.state import TaskStore
from weclaw_mq.workflows.plans import CHAIN, Plan, callback_id, task_id_of

# Cancels sent together (each one script; the auto-pipeline batches them).
CANCEL_BATCH = 200


async def cancel_outstanding(
    store: TaskStore, plan: Plan, stage: int, ended: frozenset[int], *, limit: int | None = None
) -> None:
    """Cancel the workflow's tasks that have not ended (a cancel of one that did is a no-op):
    those not published yet are cancelled ahead, so they are acked unrun when they come.
    ``limit``: only the first so many, in order (a group's parts are queued in order)."""
    wid = plan.workflow_id
    targets: list[tuple[str, str]]
    if plan.kind == CHAIN:
        targets = [(task_id_of(wid, i), plan.queue_of(i)) for i in range(stage, plan.size)]
    else:
        targets = [
            (task_id_of(wid, i), plan.queue_of(i)) for i in range(plan.size) if i not in ended
        ]
        if plan.then is not None:
            targets.append((callback_id(wid), plan.then.queue))
    targets = targets[:limit]
    for first in range(0, len(targets), CANCEL_BATCH):
        await asyncio.gather(
            *(store.cancel(t, queue=q) for t, q in targets[first : first + CANCEL_BATCH])
        )

"""Nothing waits forever: the sweep that ends a workflow still running at its deadline.

Every workflow's deadline is in one sorted set (``state.workflow_records``). Every worker
sweeps it every ``workflow_sweep_s`` (and the test kit when it goes idle): ``due`` claims up
to ``SWEEP_BATCH`` overdue workflows by pushing their deadline ``SWEEP_LEASE_MS`` on, so two
workers never end the same one together, and one that dies mid-way leaves it to the next
sweep. Ending it is one atomic step (``expire``), which only the first end of a workflow
wins: a part that completes the join at the same moment either came first (the group goes on)
or finds the group ended. The expired workflow's record names what was missing (a chain's
stage, a group's parts, or its callback), and those tasks are cancelled, so a part that turns
up late is acked unrun. Lost parts are what this catches: a message purged by an operator,
expired by RabbitMQ in its queue, or gone with a deleted queue, which no worker ever sees.

The same sweep cancels the parts still to run of a group that a part failed: that part's
delivery made the group's deadline due at once instead of sending a cancel per part before
its ack (``workflows.hops``), so they are sent after the ack, by whichever worker sweeps.
"""

from __future__ import annotations

import asyncio
import logging

from weclaw_mq.contract.lifetime import now_ms
from weclaw_mq.policy.failures import describe
from weclaw_mq.state.workflow_records import Step, workflows_of
from weclaw_mq.workflows.hops import settle_end
from weclaw_mq.workflows.host import Host
from weclaw_mq.workflows.outstanding import cancel_outstanding
from weclaw_mq.workflows.plans import Plan

log = logging.getLogger("weclaw_mq.workflows")

SWEEP_BATCH = 100
SWEEP_LEASE_MS = 30_000


async def sweep(host: Host) -> int:
    """End every workflow past its deadline that has not ended; how many this call ended."""
    flows = workflows_of(host.store)
    results = host.results
    if flows is None or results is None:
        return 0
    ended = 0
    while True:
        due = await flows.due(now_ms(), limit=SWEEP_BATCH, lease_ms=SWEEP_LEASE_MS)
        for wid in due:
            progress = await flows.progress(wid)
            if progress is None:  # never stored, or gone: nothing to end
                await flows.forget_deadline(wid)
                continue
            plan = Plan.from_json(progress.plan)
            answer = await flows.expire(wid)
            if answer.step is not Step.ENDED:
                await flows.forget_deadline(wid)
                continue
            if answer.now:
                ended += 1
                log.warning("workflow %s reached its deadline before it ended", wid)
            # Ended before (a group failed by a part, or a worker died before it dropped the
            # deadline) or now: what it still waited for need not run.
            await cancel_outstanding(results, plan, progress.stage, progress.ended_parts)
            await settle_end(host, flows, wid, answer, plan)
        if len(due) < SWEEP_BATCH:
            return ended


async def sweep_forever(host: Host, interval_s: float) -> None:
    """``sweep`` every ``interval_s`` until cancelled; a failed sweep is logged and retried."""
    while True:
        try:
            await sweep(host)
        except Exception as e:  # Redis away: the next sweep tries again
            log.warning("the workflow deadline sweep failed (%s); retrying", describe(e))
        await asyncio.sleep(interval_s)

"""A workflow's durable progress (``weclaw_mq.workflows``): the protocol, and its in-memory twin.

A workflow is a chain (stages run one after another, each stage's result the next one's
input) or a group (parts run side by side, then one callback gets their results). What it
keeps, per workflow id W (Redis: hash-tagged on W, so every step below is one script on one
node of a cluster):

- its plan (opaque JSON, written once by ``create``), kind, size and failure policy;
- its state: ``running``; ``joined`` (a group whose parts all ended: its callback is due);
  ``ended`` (with the ``outcome`` that ended it, which every later step answers);
- a chain's ``stage`` (the furthest stage started) and ``published`` (the furthest stage
  known to be on the broker: the first, and every stage that ended), so a copy of a stage
  whose successor already ended does not publish that successor again;
- a group's ended parts, by part index (the part's outcome), and ``left``, the parts not yet
  ended: a part is counted once, by its index (its task id), however often it is delivered;
- one sorted set of every workflow's deadline, which every worker sweeps (``due``): a
  workflow still not ended at its deadline is ended ``expired`` by one of them (``expire``);
  a group failed by a part has its deadline made due at once (``sweep_soon``), so a sweep
  cancels its parts still to run.

Every step that moves the state is atomic (a Lua script; a lock-free method here), and the
first step that ends a workflow wins: its ``outcome`` is kept, and every later step answers
``ENDED`` with it, so whoever writes the workflow's record writes the same one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

# How many missing parts an expired group's outcome names (it counts all of them).
MISSING_LISTED = 20

RUNNING = "running"
JOINED = "joined"
ENDED = "ended"


class Step(StrEnum):
    """What a workflow step answers: what its caller does next."""

    NEXT = "next"  # a chain's stage succeeded: publish the next stage
    PUBLISHED = "published"  # nothing to do: the next stage is out (or this copy is stale)
    COUNTED = "counted"  # a group's part is counted (now or before); others are still due
    JOINED = "joined"  # every part of the group ended: publish its callback (or end it)
    ENDED = "ended"  # the workflow has ended: ``outcome`` says how
    UNKNOWN = "unknown"  # no such workflow (never made, or expired from the store)


@dataclass(frozen=True)
class Answer:
    """A step's answer, with the workflow's outcome when it has ended."""

    step: Step
    outcome: dict[str, Any] | None = None
    # ``ENDED`` by this very step (the first to end it), not by an earlier one.
    now: bool = False
    # The workflow's plan, with ``NEXT`` and ``ENDED`` (what the caller needs next).
    plan: str | None = None


@dataclass(frozen=True)
class Progress:
    """Where a workflow is (for a cancel, which then cancels what is still to come)."""

    plan: str
    state: str
    stage: int
    ended_parts: frozenset[int] = frozenset()


def _outcome(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    value = json.loads(text)
    return value if isinstance(value, dict) else None


def answer_of(reply: Any) -> Answer:
    """A script's reply (``[step]`` or ``["ended", outcome JSON]``) as an ``Answer``."""
    parts = [p.decode() if isinstance(p, bytes) else str(p) for p in reply]
    step = Step(parts[0])
    if step is Step.NEXT:
        return Answer(step, plan=parts[1])
    if step is not Step.ENDED:
        return Answer(step)
    return Answer(step, _outcome(parts[1]), now=parts[2] == "1", plan=parts[3])


class WorkflowStore(Protocol):
    """A workflow's plan, state and parts (see the module); every step atomic."""

    async def create(
        self,
        workflow_id: str,
        plan: str,
        *,
        kind: str,
        size: int,
        policy: str,
        deadline_ms: int,
        keep_ms: int,
    ) -> str:
        """Make the workflow unless it exists, and enter its deadline.

        Args:
            workflow_id: Its id.
            plan: Its plan (JSON).
            kind: "chain" or "group".
            size: Its stages or parts.
            policy: A group's policy for failed parts ("fail" or "pass"; "" for a chain).
            deadline_ms: When it is ended ``expired`` unless it ended before (epoch ms).
            keep_ms: How long its keys are kept.

        Returns:
            The stored plan: ``plan`` when new, else the one stored before.
        """
        ...

    async def plan(self, workflow_id: str) -> str | None:
        """The workflow's plan, or None when it is not known."""
        ...

    async def chain_step(
        self, workflow_id: str, index: int, outcome: Mapping[str, Any], *, succeeded: bool
    ) -> Answer:
        """Stage ``index`` ended with ``outcome`` (so it was on the broker: ``published``).

        A stage that ``succeeded`` and is not the last answers ``NEXT`` (or ``PUBLISHED``
        when its successor is known out); any other end ends the chain with ``outcome``
        unless it ended before (a stale copy of an earlier stage answers ``PUBLISHED``).
        ``NEXT`` and ``ENDED`` carry the plan.
        """
        ...

    async def mark_published(self, workflow_id: str, index: int) -> None:
        """Stage ``index`` (or, for a group, its callback: ``index`` 1) is confirmed out."""
        ...

    async def join(
        self,
        workflow_id: str,
        index: int,
        outcome: Mapping[str, Any],
        *,
        ends_group: Mapping[str, Any] | None,
    ) -> Answer:
        """Part ``index`` ended with ``outcome``: count it once.

        ``ends_group``: the group's outcome if this part fails it (policy "fail"), else None.
        Answers ``COUNTED``, ``JOINED`` (every part ended and the callback is not confirmed
        out yet), or ``ENDED``.
        """
        ...

    async def parts(self, workflow_id: str) -> dict[int, dict[str, Any]]:
        """The outcomes of the group's ended parts, by index."""
        ...

    async def end(self, workflow_id: str, outcome: Mapping[str, Any]) -> Answer:
        """End the workflow with ``outcome`` unless it ended before (``ENDED`` either way)."""
        ...

    async def expire(self, workflow_id: str) -> Answer:
        """End the workflow ``expired`` unless it ended before; the outcome names where it
        stood: ``was`` (its state), ``stage``, and a group's ``missing`` parts (the first
        ``MISSING_LISTED``) and ``missing_count``."""
        ...

    async def progress(self, workflow_id: str) -> Progress | None:
        """Where the workflow is, or None when it is not known."""
        ...

    async def due(self, now_ms: int, *, limit: int, lease_ms: int) -> list[str]:
        """Claim up to ``limit`` workflows whose deadline passed: each is pushed ``lease_ms``
        on, so other sweepers leave it while this one ends it (and comes back if it dies)."""
        ...

    async def forget_deadline(self, workflow_id: str) -> None:
        """Drop the workflow's deadline (it ended and its record is written)."""
        ...

    async def sweep_soon(self, workflow_id: str, at_ms: int) -> None:
        """Move the workflow's deadline to ``at_ms`` if it still has one (an ended group
        whose parts still to run are the sweep's to cancel); a forgotten one stays so."""
        ...


@runtime_checkable
class HasWorkflows(Protocol):
    """A ``TaskStore`` that keeps workflows beside its tasks (the Redis and memory stores)."""

    def workflow_store(self) -> WorkflowStore:
        """The workflows (``state.workflow_records``) beside this task store's tasks.

        Returns:
            The workflow store.
        """
        ...


def workflows_of(store: object) -> WorkflowStore | None:
    """The workflow store beside ``store``, or None for a store without one."""
    return store.workflow_store() if isinstance(store, HasWorkflows) else None


# -- in memory -----------------------------------------------------------------------------


@dataclass
class _Workflow:
    plan: str
    kind: str
    size: int
    policy: str
    state: str = RUNNING
    stage: int = 0
    published: int = -1
    left: int = 0
    outcome: dict[str, Any] | None = None
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)


class MemoryWorkflowStore:
    """``WorkflowStore`` in this process's memory, with the Redis scripts' rules (nothing
    expires: a test's workflows live as long as its store)."""

    def __init__(self) -> None:
        self._flows: dict[str, _Workflow] = {}
        self._deadlines: dict[str, int] = {}

    async def create(
        self,
        workflow_id: str,
        plan: str,
        *,
        kind: str,
        size: int,
        policy: str,
        deadline_ms: int,
        keep_ms: int,
    ) -> str:
        self._deadlines.setdefault(workflow_id, deadline_ms)
        flow = self._flows.setdefault(workflow_id, _Workflow(plan, kind, size, policy, left=size))
        return flow.plan

    def _ended(self, flow: _Workflow, outcome: Mapping[str, Any] | None) -> Answer:
        if flow.state != ENDED and outcome is not None:
            flow.state, flow.outcome = ENDED, dict(outcome)
            return Answer(Step.ENDED, flow.outcome, now=True, plan=flow.plan)
        return Answer(Step.ENDED, flow.outcome, plan=flow.plan)

    async def plan(self, workflow_id: str) -> str | None:
        flow = self._flows.get(workflow_id)
        return None if flow is None else flow.plan

    async def chain_step(
        self, workflow_id: str, index: int, outcome: Mapping[str, Any], *, succeeded: bool
    ) -> Answer:
        flow = self._flows.get(workflow_id)
        if flow is None:
            return Answer(Step.UNKNOWN)
        if flow.state != RUNNING:
            return self._ended(flow, None)
        flow.published = max(flow.published, index)
        if succeeded and index + 1 < flow.size:
            if flow.published >= index + 1:
                return Answer(Step.PUBLISHED)
            flow.stage = max(flow.stage, index + 1)
            return Answer(Step.NEXT, plan=flow.plan)
        if index < flow.stage:
            return Answer(Step.PUBLISHED)
        return self._ended(flow, outcome)

    async def mark_published(self, workflow_id: str, index: int) -> None:
        flow = self._flows.get(workflow_id)
        if flow is not None:
            flow.published = max(flow.published, index)

    async def join(
        self,
        workflow_id: str,
        index: int,
        outcome: Mapping[str, Any],
        *,
        ends_group: Mapping[str, Any] | None,
    ) -> Answer:
        flow = self._flows.get(workflow_id)
        if flow is None:
            return Answer(Step.UNKNOWN)
        if flow.state == ENDED:
            return self._ended(flow, None)
        if flow.state == JOINED:
            return Answer(Step.COUNTED if flow.published == 1 else Step.JOINED)
        if index in flow.parts:
            return Answer(Step.COUNTED)
        flow.parts[index] = dict(outcome)
        flow.left -= 1
        if ends_group is not None and flow.policy == "fail":
            return self._ended(flow, ends_group)
        if flow.left <= 0:
            flow.state = JOINED
            return Answer(Step.JOINED)
        return Answer(Step.COUNTED)

    async def parts(self, workflow_id: str) -> dict[int, dict[str, Any]]:
        flow = self._flows.get(workflow_id)
        return {} if flow is None else dict(flow.parts)

    async def end(self, workflow_id: str, outcome: Mapping[str, Any]) -> Answer:
        flow = self._flows.get(workflow_id)
        if flow is None:
            return Answer(Step.UNKNOWN)
        return self._ended(flow, outcome)

    async def expire(self, workflow_id: str) -> Answer:
        flow = self._flows.get(workflow_id)
        if flow is None:
            return Answer(Step.UNKNOWN)
        if flow.state == ENDED:
            return self._ended(flow, None)
        missing = (
            [i for i in range(flow.size) if i not in flow.parts]
            if flow.kind == "group" and flow.state == RUNNING
            else []
        )
        return self._ended(
            flow,
            {
                "status": "expired",
                "by": "deadline",
                "was": flow.state,
                "stage": flow.stage,
                "missing": missing[:MISSING_LISTED],
                "missing_count": len(missing),
            },
        )

    async def progress(self, workflow_id: str) -> Progress | None:
        flow = self._flows.get(workflow_id)
        if flow is None:
            return None
        return Progress(flow.plan, flow.state, flow.stage, frozenset(flow.parts))

    async def due(self, now_ms: int, *, limit: int, lease_ms: int) -> list[str]:
        ids = sorted((d, w) for w, d in self._deadlines.items() if d <= now_ms)[:limit]
        for _, w in ids:
            self._deadlines[w] = now_ms + lease_ms
        return [w for _, w in ids]

    async def forget_deadline(self, workflow_id: str) -> None:
        self._deadlines.pop(workflow_id, None)

    async def sweep_soon(self, workflow_id: str, at_ms: int) -> None:
        if workflow_id in self._deadlines:
            self._deadlines[workflow_id] = at_ms

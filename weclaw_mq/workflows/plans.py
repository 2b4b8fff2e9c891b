"""What a workflow is made of: its stages or parts as the caller names them, the plan kept in
Redis, the tag its tasks carry, their task ids, and how its outcome reads as a record. Pure.

Task ids are derived, never drawn: stage ``i`` of chain ``C`` is ``C.i``, part ``i`` of group
``G`` is ``G.i``, and ``G``'s callback is ``G.then``. A hop that is published twice (its
worker died between the confirm and the ack) publishes the same task id twice, and the next
handler's guard runs it once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from weclaw_mq.contract.naming import CHAIN_RECORD_QUEUE, GROUP_RECORD_QUEUE
from weclaw_mq.policy.priority import Priority
from weclaw_mq.state import TaskState, TaskStatus

CHAIN = "chain"
GROUP = "group"
THEN = "then"  # a group's callback (the tag's kind; its task id ends in ".then")
# A group's policy for failed parts: "fail" ends the group at the first one (its callback
# never runs); "pass" hands every part's end to the callback.
FAIL = "fail"
PASS = "pass"
POLICIES = (FAIL, PASS)


@dataclass(frozen=True)
class Stage:
    """A stage of a chain: its handler queue, and its tasks' priority (default: the handler's).

    Args:
        queue: The handler queue that runs the stage.
        priority: The priority of the stage's task, as ``publish`` takes it.
    """

    queue: str
    priority: Priority | str | None = None


class PartResult(BaseModel):
    """How one part of a group ended, as a callback with ``on_failure="pass"`` receives it.

    Attributes:
        task_id: The part's task id (``<group id>.<index>``).
        status: succeeded, dead_lettered, expired or cancelled.
        result: The part's result (succeeded).
        error: ``ErrorName: message`` of its last failure.
        reason: Why it ended without a result (a dead-letter reason).
    """

    task_id: str
    status: TaskStatus
    result: Any = None
    error: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Plan:
    """A workflow as kept in the store (``state.workflow_records``), written once."""

    kind: str
    workflow_id: str
    stages: tuple[Stage, ...]  # a chain's; a group's one entry: its parts' queue
    size: int
    trace_id: str
    session_id: str | None
    deadline_ms: int
    started_ms: int
    then: Stage | None = None
    on_failure: str = FAIL

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        then = data.get("then")
        return cls(
            kind=data["kind"],
            workflow_id=data["workflow_id"],
            stages=tuple(Stage(**s) for s in data["stages"]),
            size=data["size"],
            trace_id=data["trace_id"],
            session_id=data.get("session_id"),
            deadline_ms=data["deadline_ms"],
            started_ms=data["started_ms"],
            then=Stage(**then) if then else None,
            on_failure=data.get("on_failure", FAIL),
        )

    @property
    def record_queue(self) -> str:
        return CHAIN_RECORD_QUEUE if self.kind == CHAIN else GROUP_RECORD_QUEUE

    def queue_of(self, index: int) -> str:
        """The handler queue of stage (or part) ``index``."""
        return self.stages[index].queue if self.kind == CHAIN else self.stages[0].queue

    def name_of(self, index: int) -> str:
        """``stage 2 of 3 (lookup, task C.1)``: a stage or part as a reason names it."""
        what = "stage" if self.kind == CHAIN else "part"
        return (
            f"{what} {index + 1} of {self.size} ({self.queue_of(index)}, "
            f"task {task_id_of(self.workflow_id, index)})"
        )


# -- the tag and the task ids ----------------------------------------------------------------


def tag(kind: str, workflow_id: str) -> str:
    """The ``headers.WORKFLOW`` value of a workflow's tasks."""
    return f"{kind}:{workflow_id}"


def task_id_of(workflow_id: str, index: int) -> str:
    return f"{workflow_id}.{index}"


def callback_id(workflow_id: str) -> str:
    return f"{workflow_id}.{THEN}"


@dataclass(frozen=True)
class Tagged:
    """What a task's tag and task id say: its workflow, its kind and its index (-1: callback)."""

    kind: str
    workflow_id: str
    index: int


def read_tag(value: object, task_id: str) -> Tagged | None:
    """The task's place in its workflow, or None when the tag does not fit its task id (a
    foreign publisher's junk: the task ends as any other, and no workflow hears of it)."""
    if not isinstance(value, str):
        return None
    kind, _, workflow_id = value.partition(":")
    if kind not in (CHAIN, GROUP, THEN) or not workflow_id:
        return None
    if kind == THEN:
        return Tagged(kind, workflow_id, -1) if task_id == callback_id(workflow_id) else None
    head, _, index = task_id.rpartition(".")
    if head != workflow_id or not index.isdigit() or str(int(index)) != index:
        return None
    return Tagged(kind, workflow_id, int(index))


# -- outcomes -------------------------------------------------------------------------------


def end_of(state: TaskState) -> dict[str, Any]:
    """A task's final record as a stage's or part's outcome."""
    return {
        "task_id": state.task_id,
        "status": state.status.value,
        "result": state.result,
        "error": state.error,
        "reason": state.reason,
    }


def failed_by(what: str, index: int, end: Mapping[str, Any]) -> dict[str, Any]:
    """The workflow's outcome when stage or part ``index`` (``what``) ended without success."""
    return {
        "status": end["status"],
        "by": what,
        "index": index,
        "error": end.get("error"),
        "reason": end.get("reason"),
    }


def callback_payload(plan: Plan, parts: Mapping[int, Mapping[str, Any]]) -> list[Any]:
    """What a group's callback receives: the parts' results in order (policy "fail": all
    succeeded), or every part's ``PartResult`` (policy "pass")."""
    ordered = [parts[i] for i in range(plan.size)]
    if plan.on_failure == FAIL:
        return [p.get("result") for p in ordered]
    return [
        {k: p.get(k) for k in ("task_id", "status", "result", "error", "reason")} for p in ordered
    ]


def record_of(plan: Plan, outcome: Mapping[str, Any]) -> TaskState:
    """The workflow's final record (``App.result(workflow id)``) from its outcome."""
    status = TaskStatus(outcome["status"])
    return TaskState(
        task_id=plan.workflow_id,
        queue=plan.record_queue,
        status=status,
        result=outcome.get("result") if status is TaskStatus.SUCCEEDED else None,
        error=outcome.get("error"),
        reason=None if status is TaskStatus.SUCCEEDED else reason_of(plan, outcome),
        expires_at=datetime.fromtimestamp(plan.deadline_ms / 1000, UTC),
    )


def running_record(plan: Plan) -> TaskState:
    """The workflow's record while it runs."""
    return TaskState(
        task_id=plan.workflow_id,
        queue=plan.record_queue,
        status=TaskStatus.RUNNING,
        expires_at=datetime.fromtimestamp(plan.deadline_ms / 1000, UTC),
    )


def reason_of(plan: Plan, outcome: Mapping[str, Any]) -> str:
    """Why the workflow ended without success, naming the stage, parts or callback."""
    by, status = outcome.get("by"), outcome["status"]
    why = f": {outcome['reason']}" if outcome.get("reason") else ""
    if by in ("stage", "part"):
        return f"{plan.name_of(outcome['index'])} {status}{why}"
    if by == "callback":
        assert plan.then is not None
        return (
            f"its callback ({plan.then.queue}, task {callback_id(plan.workflow_id)}) {status}{why}"
        )
    if by == "handoff":
        return f"{outcome.get('what', 'the next task')} could not be published{why}"
    if by == "cancel":
        return "cancelled"
    if by == "deadline":
        return _late(plan, outcome)
    return f"{status}{why}"


def _late(plan: Plan, outcome: Mapping[str, Any]) -> str:
    head = f"the {plan.kind}'s deadline passed"
    if plan.kind == CHAIN:
        stage = min(int(outcome.get("stage") or 0), plan.size - 1)
        return f"{head} before {plan.name_of(stage)} ended"
    if outcome.get("was") == "joined" and plan.then is not None:
        return (
            f"{head} before its callback ({plan.then.queue}, task "
            f"{callback_id(plan.workflow_id)}) ended"
        )
    missing = outcome.get("missing") or []
    count = int(outcome.get("missing_count") or len(missing))
    named = ", ".join(f"{i + 1} (task {task_id_of(plan.workflow_id, i)})" for i in missing)
    more = f" and {count - len(missing)} more" if count > len(missing) else ""
    return (
        f"{head} with {count} of {plan.size} parts ({plan.queue_of(0)}) not ended "
        f"(lost: purged, expired in the queue, or its queue deleted?): parts {named}{more}"
    )

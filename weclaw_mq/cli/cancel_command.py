"""``weclaw-mq cancel TASK_ID``: thin over ``App.cancel`` (``--workflow``:
``App.cancel_workflow``).

Exit 0 when the cancel took (the task was waiting or running, or, with ``--pending``, is not
known yet and will be acked unrun when it arrives); exit 1 with one error line when the task
had already finished, or has no record where the cancel looked (without ``--pending``), and
nothing was changed; 2 for a task id no task can have or an invalid queue name; 5 when Redis
does not answer (``cli.exit_codes``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from weclaw_mq.app import App
from weclaw_mq.cli.exit_codes import fail
from weclaw_mq.cli.options import task_id_value
from weclaw_mq.contract.naming import validate_queue_name
from weclaw_mq.errors import ConfigurationError
from weclaw_mq.observability.tracing import configure_logging
from weclaw_mq.state import Cancellation, CancelOutcome, TaskState


def _queue(value: str | None) -> str | None:
    try:
        return None if value is None else validate_queue_name(value)
    except ConfigurationError as e:
        raise typer.BadParameter(str(e)) from None


def _record(state: TaskState) -> str:
    return f"its latest record is in queue {state.queue} ({state.status.value})"


def cancel(
    task_id: Annotated[
        str,
        typer.Argument(metavar="TASK_ID", callback=task_id_value, help="The id publish returned."),
    ],
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="QUEUE",
            callback=_queue,
            help="Cancel the task in this queue only (default: its latest record decides, and "
            "every queue of the task id is cancelled).",
        ),
    ] = None,
    pending: Annotated[
        bool,
        typer.Option(
            "--pending",
            help="Also cancel a task with no record yet (in QUEUE, when given): it is acked "
            "unrun when it arrives. Without it, such a cancel changes nothing and exits 1.",
        ),
    ] = False,
    workflow: Annotated[
        bool,
        typer.Option(
            "--workflow",
            help="TASK_ID is a chain or group id: cancel it and its tasks still to come "
            "(App.cancel_workflow).",
        ),
    ] = False,
) -> None:
    """Cancel a task: acked unrun if waiting, its handler cancelled if running."""
    configure_logging("WARNING")
    if workflow:
        if queue is not None or pending:
            raise typer.BadParameter("--workflow takes neither --queue nor --pending")
        _cancel_workflow(task_id)
        return

    async def go() -> Cancellation:
        async with App("weclaw-mq-cli") as app:
            return await app.cancel(task_id, queue=queue, pending=pending)

    answer = asyncio.run(go())
    where = f"queue {queue}" if queue is not None else "every queue"
    other = answer.elsewhere
    if answer.outcome is CancelOutcome.FINISHED:
        status = answer.state.status.value if answer.state is not None else "finished"
        fail(f"task {task_id} already ended ({status}); nothing was cancelled")
    if answer.outcome is CancelOutcome.UNKNOWN:
        if other is not None:
            fail(
                f"task {task_id} has no record in queue {queue}; {_record(other)}: nothing "
                f"was cancelled (--queue {other.queue} cancels it there, no --queue everywhere)"
            )
        known = f" in queue {queue}" if queue is not None else ""
        fail(
            f"task {task_id} is not known{known}: nothing was cancelled (--pending cancels "
            "it for when it arrives)"
        )
    if answer.outcome is CancelOutcome.PENDING:
        if other is not None:
            typer.echo(
                f"task {task_id} has no record in queue {queue} yet; {_record(other)}, left as "
                f"it is: cancelled in queue {queue} for when it arrives"
            )
            return
        typer.echo(f"task {task_id} is not known yet: cancelled in {where} for when it arrives")
        return
    state = answer.state
    typer.echo(f"task {task_id} cancelled in queue {state.queue if state else queue}")


def _cancel_workflow(workflow_id: str) -> None:
    async def go() -> Cancellation:
        async with App("weclaw-mq-cli") as app:
            return await app.cancel_workflow(workflow_id)

    answer = asyncio.run(go())
    if answer.outcome is CancelOutcome.UNKNOWN:
        fail(f"workflow {workflow_id} is not known: nothing was cancelled")
    if answer.outcome is CancelOutcome.FINISHED:
        status = answer.state.status.value if answer.state is not None else "ended"
        fail(f"workflow {workflow_id} already ended ({status}); nothing was cancelled")
    typer.echo(f"workflow {workflow_id} cancelled, and its tasks still to come")

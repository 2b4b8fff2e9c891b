"""``weclaw-mq cancel TASK_ID``: thin over ``App.cancel``.

Exit 0 when the cancel took (the task was waiting or running, or is not known yet and will be
acked unrun when it arrives); exit 1 with one error line when the task had already finished
and nothing was changed; 5 when Redis does not answer (``cli.failures``).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from ..app import App
from ..state import Cancellation, CancelOutcome
from ..tracing import configure_logging
from .failures import fail


def cancel(
    task_id: Annotated[str, typer.Argument(metavar="TASK_ID", help="The id publish returned.")],
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="QUEUE",
            help="Cancel the task in this queue only (default: its latest record decides, and "
            "every queue of the task id is cancelled).",
        ),
    ] = None,
) -> None:
    """Cancel a task: acked unrun if waiting, its handler cancelled if running."""
    configure_logging("WARNING")

    async def go() -> Cancellation:
        async with App("weclaw-mq-cli") as app:
            return await app.cancel(task_id, queue=queue)

    answer = asyncio.run(go())
    where = f"queue {queue}" if queue is not None else "every queue"
    if answer.outcome is CancelOutcome.FINISHED:
        status = answer.state.status.value if answer.state is not None else "finished"
        fail(f"task {task_id} already ended ({status}); nothing was cancelled")
    if answer.outcome is CancelOutcome.PENDING:
        typer.echo(f"task {task_id} is not known yet: cancelled in {where} for when it arrives")
        return
    state = answer.state
    typer.echo(f"task {task_id} cancelled in queue {state.queue if state else queue}")

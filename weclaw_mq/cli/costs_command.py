"""``weclaw-mq costs MODULE:APP``: what the reported model usage cost, per tenant or per
model, over the last days; or every model call of one task (``--task``). Read from the cost
ledger in Redis (``state.cost_ledger``); exit 5 when Redis does not answer."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import typer

from weclaw_mq.app import App
from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.options import AppPath, task_id_value
from weclaw_mq.observability.tracing import configure_logging


def costs(
    app_path: AppPath,
    days: Annotated[
        int, typer.Option("--days", "-d", min=1, max=3660, metavar="N", help="UTC days back.")
    ] = 1,
    by: Annotated[
        str,
        typer.Option("--by", metavar="tenant|model", help="Sum per tenant or per model."),
    ] = "tenant",
    task_id: Annotated[
        str | None,
        typer.Option(
            "--task",
            metavar="TASK_ID",
            callback=task_id_value,
            help="Every model call of this task instead.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="One JSON document.")] = False,
) -> None:
    """Show what the model usage handlers reported cost, per tenant or model (or per task)."""
    if by not in ("tenant", "model"):
        raise typer.BadParameter(f"{by!r} is not tenant or model", param_hint="'--by'")
    configure_logging("WARNING")
    app = load_app(app_path)

    async def read(app: App) -> Any:
        async with app:
            if task_id is not None:
                return await app.calls(task_id)
            return await app.costs(days=days, by=by)

    rows = asyncio.run(read(app))
    if as_json:
        typer.echo(json.dumps([_document(r) for r in rows]))
        return
    header: tuple[str, ...]
    lines: list[tuple[str, ...]]
    if task_id is not None:
        header = ("ATTEMPT", "MODEL", "TENANT", "INPUT", "OUTPUT", "COST", "AT")
        lines = [
            (
                str(c.attempt),
                c.model,
                c.tenant,
                str(c.input_tokens),
                str(c.output_tokens),
                f"{c.cost:.6f}",
                c.at[:19],
            )
            for c in rows
        ]
    else:
        header = (by.upper(), "COST", "INPUT TOKENS", "OUTPUT TOKENS")
        lines = [(t.name, f"{t.cost:.6f}", str(t.input_tokens), str(t.output_tokens)) for t in rows]
    if not lines:
        typer.echo("no model usage recorded" + (f" for task {task_id}" if task_id else ""))
        return
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    for row in [header, *lines]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _document(row: Any) -> dict[str, Any]:
    document = dict(row.__dict__)
    document["cost"] = row.cost
    return document

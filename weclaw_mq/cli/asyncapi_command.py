"""``weclaw-mq asyncapi``: the app's contract as an AsyncAPI 3.0.0 document (JSON).

Pure inspection: the App is imported and read, nothing connects to RabbitMQ or Redis. JSON
only: PyYAML is no dependency of weclaw_mq (and a JSON document is valid YAML 1.2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.options import AppPath


def _version(value: str) -> str:
    if not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


def asyncapi(
    app_path: AppPath,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            dir_okay=False,
            help="Write the document here. Default: stdout.",
        ),
    ] = None,
    api_version: Annotated[
        str,
        typer.Option(
            "--api-version",
            callback=_version,
            metavar="VERSION",
            help="The contract's own version (info.version): weclaw_mq cannot know it.",
        ),
    ] = "1.0.0",
) -> None:
    """Print the app's AsyncAPI 3.0.0 document: each handler's queue, payload and result
    schemas, headers, DLQ; server URLs without passwords. Needs no broker or Redis."""
    from weclaw_mq.admin.asyncapi import build_document  # not on a worker's path

    app = load_app(app_path)
    text = json.dumps(build_document(app, version=api_version), indent=2, ensure_ascii=False)
    if output is None:
        typer.echo(text)
        return
    output.write_text(text + "\n", encoding="utf-8")
    typer.echo(f"wrote {output} ({len(app.handlers)} handler(s))", err=True)

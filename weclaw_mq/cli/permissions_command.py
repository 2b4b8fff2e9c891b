"""``weclaw-mq permissions``: the ``rabbitmqctl set_permissions`` lines of an app's roles."""

from __future__ import annotations

from typing import Annotated

import typer

from weclaw_mq.admin.permissions import Role, grant, set_permissions_line, vhost_of
from weclaw_mq.cli.loading import load_app
from weclaw_mq.cli.options import AppPath


def permissions(
    app_path: AppPath,
    role: Annotated[
        list[Role] | None,
        typer.Option(
            "--role",
            metavar="ROLE",
            help="worker, producer or operator (repeatable). Default: all.",
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option(
            "--user", metavar="USER", help="The RabbitMQ user (default: '<app name>-<role>')."
        ),
    ] = None,
    vhost: Annotated[
        str | None,
        typer.Option("--vhost", metavar="VHOST", help="Default: the vhost of WECLAW_MQ_AMQP_URL."),
    ] = None,
) -> None:
    """Print the least 'rabbitmqctl set_permissions' line for each role of the app."""
    app = load_app(app_path)
    where = vhost if vhost is not None else vhost_of(app.settings.amqp_urls()[0])
    specs = list(app.handlers.values())
    for r in role or list(Role):
        name = user if user is not None else f"{app.name}-{r.value}"
        typer.echo(set_permissions_line(name, where, grant(r, specs)))

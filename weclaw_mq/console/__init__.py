"""The web console (``weclaw-mq console MODULE:APP``): an app's queues and live workers, its
run history, each task's record, timeline, live output and dead letter, and the dead-letter
tools of the CLI, in a browser. Starlette, served by uvicorn, installed with the ``console``
extra; every page and asset comes from this package (no CDN, no build step).

Modules: ``access`` (token, CSRF, same origin: pure), ``guard`` (the middleware applying it),
``audit`` (one line per change), ``overview``, ``task_views`` (the task index's views),
``detail``, ``dead_letters`` (the DLQ engine's previews and jobs), ``events`` (the task stream
as SSE), ``rendering`` (the autoescaped templates), ``handling`` (what every route shares),
the routes ``login``, ``task_pages`` and ``dead_letter_pages``, and ``server``
(``create_console``).
"""

from __future__ import annotations

from weclaw_mq.console.access import Access
from weclaw_mq.console.server import create_console

__all__ = ["Access", "create_console"]

"""Which event loop a worker runs on: asyncio's own, or uvloop (``weclaw_mq[uvloop]``).

uvloop is what most async peers run on; it is optional here because it is a compiled
extension (no Windows build) and the default loop is the one every test and drill runs on.
``--loop`` or ``WECLAW_MQ_EVENT_LOOP`` chooses; what the choice costs or gains is measured
by ``make bench`` (the consume cases' ``weclaw-guard-uvloop`` rows).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from weclaw_mq.errors import ConfigurationError

EventLoopName = Literal["asyncio", "uvloop"]
EVENT_LOOPS: tuple[EventLoopName, ...] = ("asyncio", "uvloop")
T = TypeVar("T")

log = logging.getLogger("weclaw_mq.worker")

HOW_TO_GET_UVLOOP = "pip install 'weclaw_mq[uvloop]'"


def loop_factory(name: EventLoopName) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory ``asyncio.Runner`` takes for ``name`` (None: asyncio's default loop)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise ConfigurationError(
            f"the uvloop event loop was asked for (--loop / WECLAW_MQ_EVENT_LOOP) but uvloop "
            f"is not installed: {HOW_TO_GET_UVLOOP}, or use --loop asyncio"
        ) from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], name: EventLoopName) -> T:
    """``asyncio.run(main)`` on the loop named ``name``."""
    try:
        factory = loop_factory(name)
    except BaseException:
        main.close()  # never awaited: close it so no "coroutine was never awaited" warning
        raise
    if factory is not None:
        log.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)

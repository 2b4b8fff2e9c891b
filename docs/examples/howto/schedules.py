"""docs/how-to/schedules.md shows the section of this file: a nightly cron schedule in a time
zone with a payload made from its tick, and a fixed interval.

tests/integration/test_docs_howto_examples.py runs a worker and a scheduler for ``app`` against
the real broker and Redis, and checks what the page says.
"""

# --8<-- [start:module]
from datetime import datetime

from pydantic import BaseModel

from weclaw_mq import App

app = App("rescoring")  # settings come from WECLAW_MQ_* environment variables


class Day(BaseModel):
    day: str


@app.handler("rescore-day")
async def rescore_day(task: Day) -> dict[str, str]:
    return {"rescored": task.day}  # re-score yesterday's conversations


@app.handler("heartbeat")
async def heartbeat(task: dict[str, str]) -> str:
    return task["tick"]


# 03:00 in Berlin every night, DST included; a night nobody fired (no scheduler ran) is run
# once when one comes back.
app.schedule(
    "nightly-rescore",
    queue="rescore-day",
    cron="0 3 * * *",
    tz="Europe/Berlin",
    missed="catch_up",
    payload=lambda tick: {"day": tick.date().isoformat()},
)
# Every 2 s; missed ticks are skipped (the default); the task is {"schedule", "tick"}.
app.schedule("pulse", queue="heartbeat", every_s=2)


def when(tick: datetime) -> str:  # what the page's listing prints, for the test
    return tick.isoformat(timespec="seconds")
    # --8<-- [end:module]

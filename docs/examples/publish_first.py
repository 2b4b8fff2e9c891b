"""Publish one prompt to the tutorial's handler and wait for its reply (needs RabbitMQ and
Redis; docs/tutorial/index.md includes this file as it is)."""

from __future__ import annotations

import asyncio

from first_handler import QUEUE, Prompt, app


async def main() -> None:
    await app.declare()  # idempotent: the queues must exist before the first publish
    async with app:
        task_id = await app.publish(QUEUE, Prompt(text="Write a haiku"))  # confirmed
        final = await app.result(task_id, timeout_s=120)
        print(task_id, final.status, final.result)


if __name__ == "__main__":
    asyncio.run(main())

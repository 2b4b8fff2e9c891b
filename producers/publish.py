"""Publish a few prompts from plain asyncio and print their task ids.

    .venv/bin/python -m producers.publish

``App.publish`` returns only once RabbitMQ confirmed the task is stored, so every id printed
here belongs to a task that survives a crash of this script, the worker or the broker.
Queue and broker come from the environment, as for the worker (``DEMO_QUEUE``,
``WECLAW_MQ_AMQP_URL``). Start a worker to see them handled:
``weclaw-mq worker consumers.demo:app``.
"""

from __future__ import annotations

import asyncio

from consumers.demo import QUEUE, Prompt, app

COUNT = 5


async def main() -> None:
    # The queues must exist before the first publish (an unroutable task raises); declaring
    # is idempotent, so doing it here is safe even with a worker already running.
    await app.declare()
    async with app:
        for i in range(COUNT):
            prompt = Prompt(text=f"Summarise chapter {i + 1} in three lines", user_id="script")
            task_id = await app.publish(QUEUE, prompt)
            print(task_id)


if __name__ == "__main__":
    asyncio.run(main())

"""weclaw_mq against raw aio-pika, FastStream and Dramatiq on the same broker (see bench.py)."""

"""A worker's idle RSS by import layer: ``python -m benchmarks.rss_layers`` (make bench-rss).

A fresh interpreter imports what a worker imports, one layer at a time, and prints VmRSS
after each: what each layer adds on top of the ones before. It imports nothing else first
(standard library only at the top), so the first line is the bare interpreter. The benchmark
prints this under the table when an RSS target is missed (``costs.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

# What a worker loads, in order; each layer's RSS is measured on top of the ones before.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("interpreter", ()),
    ("asyncio (+ ssl)", ("asyncio", "ssl")),
    ("aio-pika, aiormq, pamqp, yarl", ("aio_pika",)),
    ("pydantic", ("pydantic", "pydantic.main")),
    ("weclaw_mq (guard off: all a worker imports)", ("weclaw_mq", "weclaw_mq.worker.consume")),
    # Any redis-py module runs the package's __init__ (client, cluster, sentinel, ...): no
    # narrower import of it exists.
    ("redis-py (guard on)", ("redis",)),
    ("the Redis store (guard on)", ("weclaw_mq.state.redis",)),
    # Only with a metrics port (or when App.metrics.registry is read).
    (
        "prometheus_client (a metrics port)",
        ("prometheus_client", "weclaw_mq.observability.metrics_server"),
    ),
)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    total = rss_mib()
    print("VmRSS by import layer (fresh interpreter, each on top of the ones above):")
    print(f"  {total:5.1f} MiB  = {total:5.1f}  {LAYERS[0][0]}")
    for name, modules in LAYERS[1:]:
        for module in modules:
            importlib.import_module(module)
        now = rss_mib()
        print(f"  +{now - total:4.1f} MiB  = {now:5.1f}  {name}")
        total = now
    print("  (a worker adds about 0.5 MiB more after 50 messages: connections, channels, buffers)")


if __name__ == "__main__":
    main()

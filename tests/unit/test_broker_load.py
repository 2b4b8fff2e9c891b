"""What the broker carries, read from ``rabbitmqctl status``: pure parsing and the warning."""

from __future__ import annotations

import json

from weclaw_mq.wire.broker_load import BrokerLoad, parse_status, read_broker_load


def _status(used: int, limit: int, rss: int, watermark: int) -> str:
    return json.dumps(
        {
            "file_descriptors": {"total_used": used, "total_limit": limit},
            "memory": {"total": {"erlang": rss - 1, "rss": rss, "allocated": rss + 1}},
            "vm_memory_high_watermark_limit": watermark,
        }
    )


def test_a_status_reads_as_handles_and_memory_against_their_limits() -> None:
    load = parse_status(_status(153, 927, 800 * 2**20, 9000 * 2**20))
    assert load == BrokerLoad(153, 927, 800 * 2**20, 9000 * 2**20)
    assert load.summary() == (
        "broker file handles: 153 of 927 in use; memory: 800 MiB of its 9000 MiB high watermark"
    )
    assert load.warning() is None


def test_within_ten_percent_of_a_limit_one_line_says_what_to_raise() -> None:
    handles = BrokerLoad(835, 927, 1, 100).warning()
    assert handles is not None and "\n" not in handles
    assert "file handles 835 of 927" in handles and "ulimit -n" in handles
    assert "memory" not in handles
    memory = BrokerLoad(1, 927, 91 * 2**20, 100 * 2**20).warning()
    assert memory is not None and "vm_memory_high_watermark" in memory
    both = BrokerLoad(900, 927, 95, 100).warning()
    assert both is not None and "ulimit -n" in both and "vm_memory_high_watermark" in both


def test_an_unreadable_status_or_a_remote_broker_reads_as_none() -> None:
    assert parse_status("") is None
    assert parse_status(json.dumps({"file_descriptors": {}})) is None
    # rabbitmqctl speaks to the node on this machine only: a remote URL is not asked.
    assert read_broker_load("amqp://guest:guest@broker.example:5672/") is None

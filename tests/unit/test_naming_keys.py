"""Redis keys of a task: one per (queue, task id), never shared by two pairs, one hash slot."""

from __future__ import annotations

import itertools
import re

import pytest

from weclaw_mq.contract.naming import (
    GUARD_KEY_PREFIX,
    STATE_KEY_PREFIX,
    cancel_key,
    done_channel,
    guard_key,
    latest_key,
    queue_key_pattern,
    state_key,
    stream_key,
    task_keys,
)

# Queue names may hold letters, digits and '_.:-'; task ids anything at all.
QUEUES = ["a", "a:b", "b", "b:c", "a:b:c", "q-1", "q_1.x", "1", "11", "1:1", "a:1:"]
TASK_IDS = ["c", "b:c", "a:b", ":", "", "1:a", "{c}", "}", "{", "x}:1:a:{y", "ü", "a b"]


def _parse(prefix: str, key: str) -> tuple[str, str]:
    """Read (queue, task id) back out of a key: possible only if the layout is unambiguous."""
    rest = key.removeprefix(prefix + ":")
    length, _, rest = rest.partition(":")
    raw = rest.encode()
    n = int(length)
    queue, tail = raw[:n].decode(), raw[n:].decode()
    assert tail.startswith(":{") and tail.endswith("}"), key
    inner = tail[2:-1]
    # An id that is empty or starts with a brace has one more '{' in front (see naming).
    return queue, inner[1:] if inner.startswith("{") else inner


def _hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes (its rule, from the cluster spec)."""
    start = key.find("{")
    if start == -1:
        return key
    end = key.find("}", start + 1)
    if end == -1 or end == start + 1:
        return key
    return key[start + 1 : end]


def test_a_colon_in_the_queue_or_the_task_id_never_makes_two_tasks_share_a_guard_key() -> None:
    assert guard_key("a:b", "c") != guard_key("a", "b:c")
    assert guard_key("a", "1:a:b") != guard_key("a:1:a", "b")


def test_a_colon_in_the_queue_or_the_task_id_never_makes_two_tasks_share_a_state_key() -> None:
    assert state_key("a:b", "c") != state_key("a", "b:c")


@pytest.mark.parametrize("prefix", [GUARD_KEY_PREFIX, STATE_KEY_PREFIX])
def test_every_queue_and_task_id_pair_reads_back_from_its_key(prefix: str) -> None:
    build = guard_key if prefix == GUARD_KEY_PREFIX else state_key
    keys = {}
    for queue, task_id in itertools.product(QUEUES, TASK_IDS):
        key = build(queue, task_id)
        assert _parse(prefix, key) == (queue, task_id)
        keys[key] = (queue, task_id)
    assert len(keys) == len(QUEUES) * len(TASK_IDS), "two (queue, task id) pairs share a key"


def test_a_tasks_keys_never_collide_with_one_another() -> None:
    every = [k for q, t in itertools.product(QUEUES, TASK_IDS) for k in task_keys(q, t)]
    latest = {latest_key(t) for t in TASK_IDS}
    per_queue = len(task_keys("q", "t")) - 1  # all but the latest pointer
    assert len(set(every) - latest) == per_queue * len(QUEUES) * len(TASK_IDS)
    assert len(latest) == len(TASK_IDS)


# Redis hashes a whole key whose tag is empty: an empty task id, or one starting with '}',
# would spread its keys if naming gave them the plain "{T}".
@pytest.mark.parametrize("task_id", [*TASK_IDS, "}x", "}}", "{}", "{{"])
def test_every_key_of_one_task_id_hashes_to_the_same_cluster_slot(task_id: str) -> None:
    keys = [k for q in QUEUES for k in task_keys(q, task_id)]
    keys += [done_channel(task_id), cancel_key(task_id), stream_key(task_id)]
    tags = {_hash_tag(k) for k in keys}
    assert len(tags) == 1, keys
    assert all(k.find("{") + 1 < k.find("}", k.find("{")) for k in keys), "an empty tag"


def test_ids_that_start_with_a_brace_keep_keys_of_their_own() -> None:
    ids = ["}x", "{}x", "{{}x", "x", "{x", "", "{", "{{", "}", "{}"]
    assert len({latest_key(t) for t in ids}) == len(ids)
    # Every other id's keys are unchanged by the escape.
    assert latest_key("a}b") == "weclaw_mq:latest:{a}b}"


def test_the_queue_scan_pattern_matches_that_queues_keys_only() -> None:
    pattern = queue_key_pattern(GUARD_KEY_PREFIX, "a")
    # Redis glob: '*' any run; no other special characters appear in queue names.
    rx = re.compile(re.escape(pattern).replace(r"\*", ".*") + "$")
    assert rx.match(guard_key("a", "b:c"))
    assert not rx.match(guard_key("a:b", "c"))
    assert not rx.match(guard_key("ab", "c"))

"""WECLAW_MQ_REDIS_URL names one Redis, a Redis Cluster or a Sentinel set: each form is read
into its topology, and a malformed one is refused when settings load, without its password."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from weclaw_mq import Settings
from weclaw_mq.config.redis_urls import RedisTopology

SECRET = "pa55-w0rd"


def test_a_cluster_url_names_its_seed_nodes_and_credentials() -> None:
    settings = Settings(redis_url=f"redis+cluster://app:{SECRET}@n1:7000,n2,[::1]:7002/0")
    assert settings.redis_topology() == RedisTopology(
        "cluster",
        (("n1", 7000), ("n2", 6379), ("::1", 7002)),
        username="app",
        password=SECRET,
    )
    assert settings.redis_url_redacted() == "redis+cluster://app:***@n1:7000,n2,[::1]:7002/0"


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    settings = Settings(redis_url=f"rediss+sentinel://:{SECRET}@s1:26380,s2/mymaster/2")
    topology = settings.redis_topology()
    assert topology == RedisTopology(
        "sentinel",
        (("s1", 26380), ("s2", 26379)),
        password=SECRET,
        service_name="mymaster",
        db=2,
        tls=True,
    )
    assert SECRET not in repr(topology)


def test_a_url_of_one_redis_has_no_topology() -> None:
    assert Settings(redis_url="redis://localhost:6379/0").redis_topology() is None


@pytest.mark.parametrize(
    "url", ["redis://h", "redis://h/", "redis://h:6379/15", "unix:///run/redis.sock?db=2"]
)
def test_a_url_of_one_redis_with_no_database_or_a_number_is_taken(url: str) -> None:
    assert Settings(redis_url=url).redis_url_plain() == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"redis+sentinel://:{SECRET}@s1:26379", "must end with /service_name"),
        (f"redis+sentinel://:{SECRET}@s1/m/0/extra", "must end with /service_name"),
        (f"redis+sentinel://:{SECRET}@s1/m/zero", "database 'zero', which is not a number"),
        (f"redis+cluster://:{SECRET}@n1:7000/1", "has no database but 0"),
        (f"redis+cluster://:{SECRET}@n1:70000", "port 70000, outside 1-65535"),
        (f"redis+cluster://:{SECRET}@n1:x", "port 'x', which is not a number"),
        (f"redis+cluster://:{SECRET}@n1,,n2", "an empty host"),
        (f"redis+cluster://:{SECRET}@n1?ssl=true", "take no ?options"),
        (f"cluster://:{SECRET}@n1", "redis+cluster:// or redis+sentinel://"),
        # redis-py would read these as database 0, silently.
        (f"redis://:{SECRET}@h/abc", "database 'abc', which is not a number"),
        (f"rediss://:{SECRET}@h:6380/1/2", "database '1/2', which is not a number"),
        (f"redis://:{SECRET}@h/-1", "database '-1', which is not a number"),
    ],
)
def test_a_malformed_url_is_refused_saying_why_and_never_showing_its_password(
    url: str, says: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(redis_url=url)
    assert says in str(raised.value)
    assert SECRET not in str(raised.value)
    assert ":***@" in str(raised.value)

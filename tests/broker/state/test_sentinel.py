"""Redis behind Sentinel (`broker/state/sentinel.py`): the URL read and shown, Celery's broker options, and
a store that goes on through a real failover (a primary SIGKILLed, its replica promoted by three Sentinels),
its Lua scripts loaded again on the new primary, inside a pipeline too."""

from __future__ import annotations

from collections.abc import Iterator

import kombu
import pytest
import redis

from broker.errors import ConfigError, StoreBusy
from broker.jobs import fills as job_fills
from broker.queueing import reaping, tickets
from broker.state.embedded import masked_url
from broker.state.scripts import HeldScript, call_pipelined
from broker.state.sentinel import celery_broker, parse_sentinel_url
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, fresh_prefix, job_spec
from tests.leasing import lease_items
from tests.sentinel_group import MASTER_NAME, SentinelGroup

URL = "sentinel://:p%40ss@10.0.0.1:26379;sentinel://:p%40ss@[fd00::2]:26380;sentinel://10.0.0.3/2"


def test_a_sentinel_url_names_its_sentinels_password_and_database() -> None:
    read = parse_sentinel_url(URL)
    assert read.sentinels == (("10.0.0.1", 26379), ("fd00::2", 26380), ("10.0.0.3", 26379))
    assert (read.password, read.username, read.db) == ("p@ss", None, 2)


def test_a_sentinel_url_is_shown_with_every_password_masked() -> None:
    assert masked_url(URL) == "sentinel://:***@10.0.0.1:26379;sentinel://:***@[fd00::2]:26380;sentinel://10.0.0.3/2"
    assert masked_url("redis://:pa;ss@h:6379/0") == "redis://:***@h:6379/0"  # (a plain URL with a ';' in its password)


@pytest.mark.parametrize(("url", "says"), [
    ("sentinel://h:1;redis://h:2/0", "every part must be sentinel://host:port"),
    ("sentinel://:a@h:1;sentinel://:b@h:2/0", "different passwords"),
    ("sentinel://h:1/0;sentinel://h:2/1", "different databases"),
    ("sentinel://h:1/zero", "not a database number"),
    ("sentinel://:secret@h:notaport/0", "port cannot be read"),
    ("sentinel://:secret;@h:1;sentinel://:secret;@h:2/0", "URL-quote any ';'"),  # (an unquoted ';')
])
def test_a_malformed_sentinel_url_says_what_to_fix_without_its_password(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        Store.connect(url, sentinel_master=MASTER_NAME)
    assert "secret" not in refused.value.message


def test_a_sentinel_url_without_its_group_names_the_setting_to_set() -> None:
    with pytest.raises(ConfigError, match="redis.sentinel_master"):
        Store.connect("sentinel://127.0.0.1:26379/0")


def test_celery_gets_the_credentials_and_database_on_every_part_and_the_group_name() -> None:
    url, options = celery_broker(URL, "sits")
    assert url == ("sentinel://:p%40ss@10.0.0.1:26379/2;sentinel://:p%40ss@[fd00::2]:26380/2;"
                   "sentinel://:p%40ss@10.0.0.3:26379/2")  # (kombu reads them from the first part alone)
    assert options["master_name"] == "sits" and options["sentinel_kwargs"]["password"] == "p@ss"
    assert "password" not in celery_broker(URL, "sits", sentinel_auth="none")[1]["sentinel_kwargs"]
    assert celery_broker("redis://:x@h:1/0", "") == ("redis://:x@h:1/0", {})


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    with SentinelGroup(tmp_path_factory.mktemp("sentinel-group")) as running:
        yield running


@pytest.fixture
def sentinel_store(group: SentinelGroup) -> Iterator[Store]:
    store = Store.connect(group.url, fresh_prefix(), sentinel_master=MASTER_NAME)
    yield store
    store.pooled_client.close()


def test_celery_publishes_and_consumes_through_the_sentinels(group: SentinelGroup) -> None:
    url, options = celery_broker(group.url, MASTER_NAME)
    with kombu.Connection(url, transport_options=options) as connection:
        queue = connection.SimpleQueue(fresh_prefix())
        queue.put({"ticket": "t1"})
        message = queue.get(timeout=5)
        message.ack()
        assert message.payload == {"ticket": "t1"}
        queue.clear()
        queue.close()


def test_a_write_refused_for_want_of_replicas_is_a_retryable_error_naming_the_setting(
        group: SentinelGroup, sentinel_store: Store) -> None:
    primary = group.client(group.primary())
    assert sentinel_store.wait_for_replicas(1, 2.0) == 1
    assert sentinel_store.wait_for_replicas(2, 0.05) == 1  # (one replica: the second never confirms)
    primary.config_set("min-replicas-to-write", 2)
    try:
        with pytest.raises(StoreBusy, match="min-replicas-to-write"):
            tickets.top_up_tickets(sentinel_store, now=NOW, target=1)
    finally:
        primary.config_set("min-replicas-to-write", 0)


def test_after_a_failover_the_store_reaches_the_new_primary_and_loads_its_scripts_in_a_pipeline_too(
        group: SentinelGroup, sentinel_store: Store) -> None:
    store = sentinel_store
    spec = job_spec(rows_total=12, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=10)
    assert len(leased) == 3
    assert store.wait_for_replicas(1, 2.0) == 1  # the replica holds the leases: the failover loses none

    old = group.kill_primary()
    new = group.wait_failover(old.port)
    try:
        # the new primary never got the scripts: a pipeline of EVALSHA alone meets NOSCRIPT
        plain = group.client(new).pipeline(transaction=False)
        plain.execute_command(*store.scripts.reap_leases.command([store.keys.inflight(MODEL_REF)], [NOW, 3, 10, "[]"]))
        with pytest.raises(redis.exceptions.NoScriptError):
            plain.execute()
        # the reaper's pass sends its calls in one pipeline: loaded again, sent again, the leases returned
        result = reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)
        assert result.returned == 3
        assert len(lease_items(store, MODEL_REF, now=NOW + 12, lease_seconds=10, max_items=10)) == 3
        # a call that ran is not sent again: only those Redis answered NOSCRIPT
        counted = HeldScript(store.client, store.client.register_script("return redis.call('INCR', KEYS[1])"))
        other = HeldScript(store.client, store.client.register_script("return redis.call('INCRBY', KEYS[1], 10)"))
        group.client(new).script_flush()
        counted.load()
        key = f"{store.keys.prefix}:pipelined"  # (a plain counter of this test)
        # (the call sent again runs after the others: 1, then 2, then 2 + 10)
        assert call_pipelined(store.client, [(counted, [key], []), (other, [key], []), (counted, [key], [])]) \
            == [1, 12, 2]
    finally:
        group.restart(old)  # (a replica again: the group is whole for the module's other tests)
    assert group.client(old).info("replication")["role"] == "slave"

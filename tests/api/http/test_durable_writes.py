"""`redis.wait_replicas`: the API acknowledges a stored write only once that many replicas hold it
(`sits_api/http/durable_writes.py`), against the session's real Redis, which has no replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.app import create_app
from sits_api.http.durable_writes import acknowledges_a_write
from tests.api.api_helpers import Api, error_of, make_settings


def _api(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path, replicas: int) -> Api:
    settings: Settings = make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        redis={"wait_replicas": replicas, "wait_timeout": "50ms"})
    return Api(create_app(settings, store=store).test_client(), create_api_key(store, "test", "admin"))


def test_a_write_no_replica_confirmed_is_a_retryable_503_that_says_to_look_before_sending_it_again(
        redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> None:
    api = _api(redis_server, store, tmp_path, zoo_dir, replicas=1)
    made = api.post("/v1/keys", json={"name": "alice", "role": "user"})
    assert made.status_code == 503 and made.get_json()["code"] == "store_busy"
    assert "0 of the 1 replicas" in error_of(made) and "redis.wait_replicas" in error_of(made)
    # Redis took it all the same: the answer only says no replica confirmed it
    assert [key["name"] for key in api.get("/v1/keys").get_json()["keys"]].count("alice") == 1
    assert api.get("/v1/status").status_code == 200  # a read waits for nothing


def test_without_wait_replicas_a_write_is_answered_at_once(redis_server: EmbeddedRedis, store: Store, tmp_path: Path,
                                                          zoo_dir: Path) -> None:
    api = _api(redis_server, store, tmp_path, zoo_dir, replicas=0)
    assert api.post("/v1/keys", json={"name": "alice", "role": "user"}).status_code == 201


@pytest.mark.parametrize(("method", "status", "waits"), [
    ("POST", 201, True), ("POST", 202, True), ("POST", 200, False), ("POST", 409, False),
    ("PUT", 200, True), ("DELETE", 204, True), ("DELETE", 404, False), ("GET", 200, False),
])
def test_what_waits_is_an_answer_that_says_something_is_stored(method: str, status: int, waits: bool) -> None:
    assert acknowledges_a_write(method, status) is waits

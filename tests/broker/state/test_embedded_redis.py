"""The embedded Redis launcher, and the small Redis-backed stores: model registry and API keys."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.errors import ConfigError, ConnectionLost, Forbidden, ModelNotFound, Unauthorized
from broker.models import registry
from broker.state.embedded import EmbeddedRedis, find_redis_server, free_port
from broker.state.store import Store
from broker.tenants import apikeys


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def durable_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A throw-away redis-server with AOF, stopped afterwards whatever the test did to it."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True)
    yield server
    server.stop(kill=True)


# --- the launcher -------------------------------------------------------------------------------


def test_find_redis_server_returns_an_executable() -> None:
    assert os.access(find_redis_server(), os.X_OK)


def test_free_port_can_be_bound_on_loopback() -> None:
    port = free_port()

    assert 0 < port < 65536


def test_starts_on_a_free_loopback_port_and_answers_ping(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()

    client = redis.Redis.from_url(durable_redis.url)
    try:
        assert client.ping() is True
        assert durable_redis.url == f"redis://:{durable_redis.password}@127.0.0.1:{durable_redis.port}/0"
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("appendonly")["appendonly"] == "yes"
    finally:
        client.close()


def test_two_servers_get_different_ports(tmp_path: Path) -> None:
    with (
        EmbeddedRedis(tmp_path / "a", appendonly=False) as first,
        EmbeddedRedis(tmp_path / "b", appendonly=False) as second,
    ):
        assert first.port != second.port
        assert Store.connect(first.url).ping() and Store.connect(second.url).ping()


def test_stop_ends_exactly_the_process_it_started(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()
    assert durable_redis.process is not None
    pid = durable_redis.process.pid

    durable_redis.stop()

    assert durable_redis.process is None
    assert not process_exists(pid)
    with pytest.raises(ConnectionLost):
        Store.connect(durable_redis.url).ping()
    durable_redis.stop()  # stopping twice is harmless


def test_context_manager_stops_the_server(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path, appendonly=False) as server:
        assert server.process is not None
        pid = server.process.pid
        assert Store.connect(server.url).ping()

    assert not process_exists(pid)


def test_start_fails_clearly_when_the_port_is_taken(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    squatter = EmbeddedRedis(tmp_path, port=redis_server.port, appendonly=False)
    try:
        with pytest.raises(ConnectionLost, match="exited at start"):
            squatter.start()
    finally:
        squatter.stop()

    assert Store.connect(redis_server.url).ping()  # the session's server is untouched


def test_value_survives_sigterm_and_restart(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()
    port = durable_redis.port
    client = redis.Redis.from_url(durable_redis.url, decode_responses=True)
    client.set("sits:test", "kept")
    client.close()

    durable_redis.stop()  # SIGTERM: Redis flushes its AOF on the way out
    durable_redis.start()

    assert durable_redis.port == port
    client = redis.Redis.from_url(durable_redis.url, decode_responses=True)
    try:
        assert client.get("sits:test") == "kept"
    finally:
        client.close()


def test_value_survives_sigkill_with_appendonly(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()
    client = redis.Redis.from_url(durable_redis.url, decode_responses=True)
    client.hset("sits:job", mapping={"status": "running", "chunks_done": "7"})
    client.close()
    time.sleep(1.5)  # appendfsync everysec: let the write reach the disk

    durable_redis.stop(kill=True)
    assert (durable_redis.data_dir / "appendonlydir").exists() or (durable_redis.data_dir / "appendonly.aof").exists()
    durable_redis.start()

    client = redis.Redis.from_url(durable_redis.url, decode_responses=True)
    try:
        assert client.hgetall("sits:job") == {"status": "running", "chunks_done": "7"}
    finally:
        client.close()


# --- model registry ---------------------------------------------------------------------------------


def model_record(name: str, version: str, registered_at: float) -> dict[str, object]:
    return {
        "name": name,
        "version": version,
        "path": f"/models/{name}/{version}/model.onnx",
        "registered_at": registered_at,
    }


def test_bare_name_resolves_to_the_newest_version(store: Store) -> None:
    registry.save_model_version(store, model_record("mlp", "a1", 1.0))
    registry.save_model_version(store, model_record("mlp", "b2", 2.0))

    assert registry.get_model(store, "mlp").version == "b2"
    assert registry.get_model(store, "mlp@a1").version == "a1"
    assert registry.get_model(store, "mlp@b2").path == "/models/mlp/b2/model.onnx"


def test_saving_without_make_latest_keeps_the_current_version(store: Store) -> None:
    registry.save_model_version(store, model_record("mlp", "a1", 1.0))
    registry.save_model_version(store, model_record("mlp", "b2", 2.0), make_latest=False)

    assert registry.get_model(store, "mlp").version == "a1"
    assert registry.get_model(store, "mlp@b2").version == "b2"


def test_unknown_model_error_lists_the_registered_models(store: Store) -> None:
    registry.save_model_version(store, model_record("mlp", "a1", 1.0))
    registry.save_model_version(store, model_record("cnn", "c3", 1.0))

    with pytest.raises(ModelNotFound) as caught:
        registry.get_model(store, "resnet")

    assert "model 'resnet' is not registered" in caught.value.message
    assert "registered models: cnn, mlp" in caught.value.message
    assert caught.value.http_status == 404


def test_an_unknown_model_lists_at_most_twenty_names_and_a_name_s_versions_are_its_own(store: Store) -> None:
    """A 404's answer stays short however many models are registered; a name's versions are read alone."""
    for n in range(25):
        registry.save_model_version(store, model_record(f"m{n:02d}", "v1", 1.0))
    registry.save_model_version(store, model_record("m00", "v2", 2.0))
    registry.save_model_version(store, model_record("m0", "v9", 2.0))  # (a name that m00's glob must not take)

    with pytest.raises(ModelNotFound) as caught:
        registry.get_model(store, "nope")

    assert "registered models: m0, m00, m01," in caught.value.message and "and 6 more" in caught.value.message
    assert [record.version for record in registry.list_model_versions(store, "m00")] == ["v1", "v2"]
    assert [record.version for record in registry.list_model_versions(store, "m0")] == ["v9"]


def test_unknown_version_of_a_known_model_is_not_found(store: Store) -> None:
    registry.save_model_version(store, model_record("mlp", "a1", 1.0))

    with pytest.raises(ModelNotFound, match=r"model version 'mlp@zz' is not registered"):
        registry.get_model(store, "mlp@zz")


def test_not_found_with_nothing_registered_says_none(store: Store) -> None:
    with pytest.raises(ModelNotFound, match=r"registered models: none"):
        registry.get_model(store, "mlp")


def test_update_model_version_merges_fields(store: Store) -> None:
    registry.save_model_version(store, model_record("mlp", "a1", 1.0))

    merged = registry.update_model_version(store, "mlp@a1", {"profile": {"latency_ms": 3.5}})

    assert merged.profile == {"latency_ms": 3.5}
    assert registry.get_model(store, "mlp@a1") == merged
    assert merged.path == "/models/mlp/a1/model.onnx"
    with pytest.raises(ModelNotFound):
        registry.update_model_version(store, "mlp@nope", {"profile": {}})


def test_list_model_versions_marks_the_latest(store: Store) -> None:
    registry.save_model_version(store, model_record("mlp", "b2", 2.0))
    registry.save_model_version(store, model_record("mlp", "a1", 1.0), make_latest=False)
    registry.save_model_version(store, model_record("cnn", "c3", 5.0))

    listed = [(r.name, r.version, r.latest) for r in registry.list_model_versions(store)]
    only_mlp = [r.version for r in registry.list_model_versions(store, "mlp")]

    assert listed == [("cnn", "c3", True), ("mlp", "a1", False), ("mlp", "b2", True)]
    assert only_mlp == ["a1", "b2"]
    assert registry.list_model_names(store) == ["cnn", "mlp"]


def test_split_model_ref() -> None:
    assert registry.split_model_ref("mlp@a1") == ("mlp", "a1")
    assert registry.split_model_ref("mlp") == ("mlp", None)


# --- API keys -------------------------------------------------------------------------------------


def test_created_key_authenticates_with_its_name_and_role(store: Store) -> None:
    key = apikeys.create_api_key(store, "ci-bot", role="admin")

    assert apikeys.authenticate(store, key) == {"name": "ci-bot", "role": "admin", "tenant": "ci-bot"}


def test_a_key_belongs_to_the_tenant_it_was_created_for_else_to_its_own_name(store: Store) -> None:
    of_acme = apikeys.create_api_key(store, "alice", role="tenant-admin", tenant="acme")
    alone = apikeys.create_api_key(store, "bob")

    assert apikeys.authenticate(store, of_acme) == {"name": "alice", "role": "tenant-admin", "tenant": "acme"}
    assert apikeys.authenticate(store, alone)["tenant"] == "bob"
    with pytest.raises(ValueError, match="tenant 'a b' must be letters"):
        apikeys.create_api_key(store, "carol", tenant="a b")


def test_who_may_read_and_steer_a_record_by_role_and_tenant() -> None:
    admin = {"name": "ops", "role": "admin", "tenant": "ops"}
    tenant_admin = {"name": "alice", "role": "tenant-admin", "tenant": "acme"}
    user = {"name": "bob", "role": "user", "tenant": "acme"}
    viewer = {"name": "vic", "role": "viewer", "tenant": "acme"}
    metrics = {"name": "prom", "role": "metrics", "tenant": "prom"}
    bobs, carols, others = ("bob", "acme"), ("carol", "acme"), ("dave", "globex")

    assert [apikeys.owns(key, *bobs) for key in (admin, tenant_admin, user, viewer, metrics)] == [
        True, True, True, False, False]
    assert [apikeys.owns(key, *carols) for key in (admin, tenant_admin, user, viewer)] == [True, True, False, False]
    assert [apikeys.may_read(key, *carols) for key in (admin, tenant_admin, user, viewer)] == [True, True, False, True]
    assert [apikeys.may_read(key, *others) for key in (admin, tenant_admin, user, viewer)] == [
        True, False, False, False]
    assert apikeys.may_read(tenant_admin, "acme", None)  # a record stored before tenants: its owner was its tenant
    assert not apikeys.may_read(viewer, None, None) and apikeys.may_read(admin, None, None)


def test_keys_are_stored_as_digests_only(store: Store) -> None:
    key = apikeys.create_api_key(store, "alice")

    stored = store.client.hgetall(store.keys.api_keys)

    assert list(stored) == [hashlib.sha256(key.encode()).hexdigest()]
    assert key not in str(stored)


@pytest.mark.parametrize("key", [None, ""])
def test_missing_key_is_unauthorized(store: Store, key: str | None) -> None:
    with pytest.raises(Unauthorized, match="missing API key"):
        apikeys.authenticate(store, key)


def test_unknown_key_is_unauthorized(store: Store) -> None:
    apikeys.create_api_key(store, "alice")

    with pytest.raises(Unauthorized, match="unknown API key") as caught:
        apikeys.authenticate(store, "sits_not-a-real-key")

    assert caught.value.http_status == 401


def test_a_tenant_is_never_named_as_an_admin_key_acts(store: Store) -> None:
    """An admin key acts as the tenant of its name: a user key of that tenant would own what that admin submitted."""
    apikeys.create_api_key(store, "ops", role="admin")
    apikeys.create_api_key(store, "alice", role="user")
    stored = store.client.hgetall(store.keys.api_keys)

    with pytest.raises(ValueError) as refused:
        apikeys.create_api_key(store, "ops", role="user")
    assert str(refused.value) == ("tenant 'ops' is named like an admin key, whose work a tenant of that name would "
                                  "own; give the key another tenant")
    with pytest.raises(ValueError, match="key name 'alice' is a tenant's: .* give the admin key another name"):
        apikeys.create_api_key(store, "alice", role="admin")
    assert store.client.hgetall(store.keys.api_keys) == stored

    more = [apikeys.create_api_key(store, "ops", role="admin"), apikeys.create_api_key(store, "alice", role="user"),
            apikeys.create_api_key(store, "ops", role="user", tenant="acme")]
    assert [apikeys.authenticate(store, key) for key in more] == [{"name": "ops", "role": "admin", "tenant": "ops"},
                                                                   {"name": "alice", "role": "user", "tenant": "alice"},
                                                                   {"name": "ops", "role": "user", "tenant": "acme"}]

def test_keys_of_both_roles_created_at_once_under_one_name_get_one_role(store: Store) -> None:
    roles = ["admin", "user"] * 4
    start = threading.Barrier(len(roles))
    refused: list[str] = []

    def create(role: str) -> None:
        start.wait()
        try:
            apikeys.create_api_key(store, "shared", role=role)
        except ValueError:
            refused.append(role)

    threads = [threading.Thread(target=create, args=(role,)) for role in roles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    stored_roles = {json.loads(raw)["role"] for raw in store.client.hvals(store.keys.api_keys)}
    assert len(stored_roles) == 1 and refused == [role for role in roles if role not in stored_roles]
    assert len(refused) == 4


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        apikeys.create_api_key(None, "x", role="root")  # type: ignore[arg-type]


def test_require_role_lets_admins_do_everything() -> None:
    apikeys.require_role({"name": "root", "role": "admin"}, "user")
    apikeys.require_role({"name": "alice", "role": "user"}, "user")

    with pytest.raises(Forbidden, match="needs the 'admin' role; key 'alice' has 'user'"):
        apikeys.require_role({"name": "alice", "role": "user"}, "admin")


def test_a_second_server_is_refused_a_data_folder_a_live_one_uses(durable_redis: EmbeddedRedis) -> None:
    """Two servers appending to one AOF corrupt it: the second is refused, naming the first's PID."""
    durable_redis.start()
    assert durable_redis.process is not None
    pid = durable_redis.process.pid

    second = EmbeddedRedis(durable_redis.data_dir, appendonly=True)
    try:
        with pytest.raises(ConfigError, match=rf"a redis-server \(PID {pid}\) already uses the Redis data folder "
                                              rf".*stop that one first \(`kill {pid}`"):
            second.start()
    finally:
        second.stop(kill=True)  # only if it was started after all

    assert second.process is None
    assert Store.connect(durable_redis.url).ping()


def test_a_pid_file_left_by_a_killed_server_does_not_block_the_folder(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()
    durable_redis.stop(kill=True)  # no chance to remove its pid file
    assert durable_redis.pid_file.exists()

    durable_redis.start()

    assert Store.connect(durable_redis.url).ping()


def test_the_server_stops_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    """A SIGKILLed launcher (`sitsctl up` killed) leaves no redis-server behind on Linux."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    script = ("import sys, time; from pathlib import Path; from broker.state.embedded import EmbeddedRedis; "
              "server = EmbeddedRedis(Path(sys.argv[1]), appendonly=False).start(); "
              "print(server.process.pid, flush=True); time.sleep(120)")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "redis")], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        assert process_exists(pid)
    finally:
        launcher.kill()
        launcher.wait()

    deadline = time.monotonic() + 10
    while process_exists(pid) and not _is_zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = process_exists(pid) and not _is_zombie(pid)
    if outlived:
        os.kill(pid, signal.SIGKILL)  # the server this test started, by its PID: leave nothing behind
    assert not outlived, f"redis-server {pid} outlived its launcher"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False

"""The embedded Redis is locked: a password of its own, kept off the command line, and private files.

Real redis-server processes throughout; any local user can reach a loopback port, so only the password
keeps them out.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.state.embedded import EmbeddedRedis, make_private_folder, masked_url, write_private_file


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def raw_reply(port: int, command: bytes) -> bytes:
    """What the server answers `command` on a fresh connection that never authenticated (no client library)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(256)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The commonest umask (022), whatever the test process had: files it makes are world-readable by default."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def durable_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True)
    yield server
    server.stop(kill=True)


def test_a_client_without_the_password_is_refused_and_one_with_the_url_is_served(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()

    assert raw_reply(durable_redis.port, b"SET probe x\r\n").startswith(b"-NOAUTH")
    assert raw_reply(durable_redis.port, b"AUTH not-the-password\r\n").startswith(b"-WRONGPASS")
    with redis.Redis(host="127.0.0.1", port=durable_redis.port) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with redis.Redis.from_url(durable_redis.url) as client:
        assert client.ping() is True
        assert client.config_get("protected-mode")["protected-mode"] == "yes"


def test_the_password_stays_off_the_command_line_in_a_private_config_file(
        tmp_path: Path, loose_umask: None) -> None:
    data_dir = tmp_path / "redis"
    data_dir.mkdir(mode=0o755)  # (a folder made by someone else first, readable by all)

    with EmbeddedRedis(data_dir, appendonly=False) as server:
        assert server.process is not None
        argv = [str(arg) for arg in server.process.args]  # what redis-server was started with (ps shows it)
        assert argv[1] == str(server.config_file) and not any(server.password in arg for arg in argv)
        if Path(f"/proc/{server.process.pid}/cmdline").exists():
            assert server.password.encode() not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert server.config_file.parent == data_dir
        assert mode_of(server.config_file) == 0o600
        assert mode_of(data_dir) == 0o700


def test_two_servers_get_different_passwords(tmp_path: Path) -> None:
    first, second = EmbeddedRedis(tmp_path / "a"), EmbeddedRedis(tmp_path / "b")

    assert first.password != second.password and len(first.password) >= 32


def test_a_restart_keeps_the_password_so_clients_made_before_it_reconnect(durable_redis: EmbeddedRedis) -> None:
    durable_redis.start()
    client = redis.Redis.from_url(durable_redis.url, decode_responses=True)
    client.set("sits:test", "kept")
    password = durable_redis.password

    durable_redis.stop()
    durable_redis.start()

    try:
        assert durable_redis.password == password
        assert client.get("sits:test") == "kept"  # (the same client: a new connection, the same password)
    finally:
        client.close()


def test_a_new_launcher_over_the_same_append_only_data_gets_a_new_password_and_the_data(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis", appendonly=True).start()
    try:
        with redis.Redis.from_url(first.url, decode_responses=True) as client:
            client.set("sits:test", "kept")
    finally:
        first.stop()  # SIGTERM: the AOF is flushed

    with EmbeddedRedis(tmp_path / "redis", appendonly=True) as second:
        assert second.password != first.password
        with redis.Redis.from_url(second.url, decode_responses=True) as client:
            assert client.get("sits:test") == "kept"
        with redis.Redis(host="127.0.0.1", port=second.port, password=first.password) as stale:
            with pytest.raises(redis.AuthenticationError):
                stale.ping()


def test_a_password_given_with_any_characters_is_the_one_the_server_asks_for(tmp_path: Path) -> None:
    password = 'a b"c\\d\'e#f:g@h/i\u00e9'

    with EmbeddedRedis(tmp_path / "redis", appendonly=False, password=password) as server:
        with redis.Redis(host="127.0.0.1", port=server.port, password=password) as client:
            assert client.ping() is True
        with redis.Redis.from_url(server.url) as client:
            assert client.ping() is True


# --- private files and folders, masked URLs ----------------------------------------------------------------


def test_a_private_file_is_0600_when_made_and_when_it_existed_looser(tmp_path: Path, loose_umask: None) -> None:
    made, existed = tmp_path / "made", tmp_path / "existed"
    existed.write_text("old and longer\n")
    existed.chmod(0o644)

    write_private_file(made, "secret\n")
    write_private_file(existed, "new\n")

    assert mode_of(made) == mode_of(existed) == 0o600
    assert existed.read_text() == "new\n"


def test_a_private_folder_is_made_0700_and_one_of_ours_is_tightened(tmp_path: Path, loose_umask: None) -> None:
    made, existed = tmp_path / "a" / "made", tmp_path / "existed"
    existed.mkdir(mode=0o755)
    existed.chmod(0o755)

    make_private_folder(made)
    make_private_folder(existed)

    assert mode_of(made) == mode_of(existed) == 0o700


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("rediss://sits-api:p%40ss@redis.internal:6380/2", "rediss://sits-api:***@redis.internal:6380/2"),
    ("redis://:p@ss@host:1/0", "redis://:***@host:1/0"),
    ("redis://host:1/0?password=s3cret&db=2", "redis://host:1/0?password=***&db=2"),
    ("unix:///run/redis.sock?password=s3cret", "unix:///run/redis.sock?password=***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://user@host:1/0", "redis://user@host:1/0"),
    ("", ""),
])
def test_a_masked_url_hides_the_password_and_keeps_the_rest(url: str, shown: str) -> None:
    assert masked_url(url) == shown

"""What lets workers on other hosts join: `redis.bind` and `redis.port` (`sitsctl up --listen`), the URL the
embedded Redis then names, and `sitsctl worker --redis URL`."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis, free_port
from sits_api.cli.main import cli

CLEAN_ENV = {"SITS_API_URL": None, "SITS_API_KEY": None, "SITS_REDIS_URL": None, "SITS_CONFIG": None}


@pytest.mark.parametrize(("given", "kept"), [("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("::1", "::1"),
                                             ("[::1]", "::1")])
def test_redis_bind_takes_one_address(given: str, kept: str) -> None:
    assert Settings().with_overrides(redis={"bind": given}).redis.bind == kept


@pytest.mark.parametrize(("given", "said"), [("0.0.0.0", "every address"), ("::", "every address"),
                                             ("redis-host", "not an IP address")])
def test_redis_bind_refuses_every_address_and_names(given: str, said: str) -> None:
    with pytest.raises(Exception, match=said):
        Settings().with_overrides(redis={"bind": given})


def test_the_embedded_redis_listens_on_its_bind_address_and_its_url_names_it(tmp_path: Path) -> None:
    port = free_port("::1")
    with EmbeddedRedis(tmp_path, appendonly=False, bind="::1", port=port) as server:
        assert server.url.endswith(f"@[::1]:{port}/0")
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(ConnectionRefusedError):  # not on IPv4 loopback
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_up_refuses_listen_beside_an_external_redis(tmp_path: Path) -> None:
    env = CLEAN_ENV | {"SITS_HOME": str(tmp_path), "SITS_REDIS_URL": "redis://10.0.0.9:6379/0"}
    result = CliRunner().invoke(cli, ["up", "--listen", "10.0.0.5"], env=env)
    assert result.exit_code == 2 and "--listen is the embedded Redis's address" in result.output


def test_worker_with_redis_joins_that_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--redis` wins over a stack's recorded Redis and SITS_REDIS_URL; the worker process gets it."""
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execvpe", lambda file, argv, env: started.append((argv, env)))
    url = "redis://:secret@10.0.0.5:6390/0"
    env = CLEAN_ENV | {"SITS_HOME": str(tmp_path), "SITS_REDIS_URL": "redis://10.0.0.9:6379/0"}
    result = CliRunner().invoke(cli, ["worker", "--cpu", "--streams", "1", "--redis", url], env=env)
    assert result.exit_code == 0, result.output
    [(argv, worker_env)] = started
    assert worker_env["SITS_REDIS_URL"] == url and worker_env["SITS_WORKER_DEVICE"] == "cpu"
    assert argv[argv.index("--queues") + 1] == "sits"


def test_worker_refuses_an_empty_redis(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["worker", "--cpu", "--redis", " "], env=CLEAN_ENV | {"SITS_HOME": str(tmp_path)})
    assert result.exit_code == 2 and "--redis must name a Redis URL" in result.output

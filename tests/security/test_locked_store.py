"""A local user who is not the stack's cannot use its store: the embedded Redis asks for a password, the
files that hold secrets are the stack user's alone, and no answer, output or log shows the password.

One real stack (`sitsctl up`'s `Stack`: Redis, the API, one worker) for the module, started under the
commonest umask (022), in a `$SITS_HOME` that already exists and is readable by everyone.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("locked-store") / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    previous = os.umask(0o022)  # files made with the default mode are then readable by every user
    try:
        running = start_stack(home, workers=1, streams=1)
    finally:
        os.umask(previous)
    yield running
    running.stop()


def recorded_redis_url(stack: Stack) -> str:
    """The Redis URL `sitsctl up` records for the other commands."""
    return (stack.home / "redis-url").read_text().strip()


def the_password(stack: Stack) -> str:
    password = urllib.parse.urlsplit(recorded_redis_url(stack)).password
    assert password, "the stack's Redis has no password"
    return urllib.parse.unquote(password)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_stack_s_redis_refuses_a_client_without_the_password(stack: Stack) -> None:
    port = urllib.parse.urlsplit(recorded_redis_url(stack)).port
    assert port

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # what any local user can do
        sock.sendall(b"PING\r\n")
        assert sock.recv(256).startswith(b"-NOAUTH")
    with redis.Redis(host="127.0.0.1", port=port) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with redis.Redis.from_url(recorded_redis_url(stack)) as client:
        assert client.ping() is True


def test_sits_home_is_private_and_every_file_holding_a_secret_is_0600(stack: Stack) -> None:
    home = stack.home
    redis_config = home / "redis" / "redis.conf"

    assert mode_of(home) == 0o700
    assert mode_of(home / "redis") == 0o700
    secrets = {name: mode_of(home / name) for name in ("api-key", "redis-url", "run/sits-config.yaml")}
    assert secrets == dict.fromkeys(secrets, 0o600)
    assert redis_config.is_file() and mode_of(redis_config) == 0o600
    assert "requirepass" in redis_config.read_text()
    assert the_password(stack) in (home / "run" / "sits-config.yaml").read_text()  # (the children read it there)


def test_status_answers_the_redis_url_with_its_password_masked(stack: Stack) -> None:
    password = the_password(stack)
    port = urllib.parse.urlsplit(recorded_redis_url(stack)).port
    request = urllib.request.Request(f"{stack.api_url}/v1/status", headers={"Authorization": f"Bearer {stack.api_key}"})

    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read().decode()

    assert password not in body and urllib.parse.quote(password, safe="") not in body
    assert stack.client().get("/v1/status")["redis_url"] == f"redis://:***@127.0.0.1:{port}/0"


def test_sitsctl_status_and_the_logs_do_not_show_the_password(stack: Stack) -> None:
    password = the_password(stack)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(stack.home)}

    status = subprocess.run([sys.executable, "-m", "sits_api.cli", "status"], env=env, capture_output=True,
                            text=True, timeout=60)

    assert status.returncode == 0, status.stdout + status.stderr
    assert "Redis redis://:***@127.0.0.1:" in status.stdout and password not in status.stdout + status.stderr
    logs = {path.name: path.read_text(errors="replace") for path in (stack.home / "logs").glob("*.log")}
    assert "worker0.log" in logs and "api.log" in logs
    assert [name for name, text in logs.items() if password in text] == []

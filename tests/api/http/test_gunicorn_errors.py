"""Requests gunicorn refuses before Flask sees them answer the API's JSON error body (sits_api/http/gunicorn_worker.py).

The server is the real one: gunicorn started with the stack's argv (`api_command`) on a free
loopback port, over the session's Redis; requests are raw bytes on a socket.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis, free_port
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.cli.client import ApiClient, ApiError
from sits_api.cli.stack import api_command
from sits_api.http.gunicorn_worker import error_message

BODY_TIMEOUT = 1.0
"""The API's `api.body_timeout` here (30 s by default)."""


@pytest.fixture(scope="module")
def api_settings(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("gunicorn-api")
    return Settings().with_overrides(redis={"url": redis_server.url, "key_prefix": "t" + uuid.uuid4().hex[:10]},
                                     api={"host": "127.0.0.1", "port": free_port(), "body_timeout": BODY_TIMEOUT},
                                     paths={"home": home})


@pytest.fixture(scope="module")
def api_key(api_settings: Settings) -> str:
    """A user key of the API's Redis."""
    return create_api_key(Store.connect(api_settings.redis.url, api_settings.redis.key_prefix), "tester")


@pytest.fixture(scope="module")
def api_port(api_settings: Settings) -> Iterator[int]:
    """The API under gunicorn, as `sitsctl up` starts it; stopped by its PID."""
    settings = api_settings
    home = Path(settings.paths.home)
    config = home / "sits-config.yaml"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
    log = home / "api.log"
    with open(log, "wb") as log_file:
        server = subprocess.Popen(api_command(settings), stdin=subprocess.DEVNULL, stdout=log_file,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, SITS_CONFIG=str(config)))
    try:
        _wait_ready(ApiClient(settings.api.public_url(), "none", timeout=1), server, log)
        yield settings.api.port
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_ready(client: ApiClient, server: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, f"gunicorn exited with code {server.returncode}: {log.read_text()[-1500:]}"
        try:
            client.get("/readyz")
            return
        except ApiError:
            assert time.monotonic() < deadline, f"the API did not answer /readyz in {timeout}s"
            time.sleep(0.1)


def send_raw(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send `request` as is on a new connection: the response's status and JSON body.

    Fails the test unless the body is the API's JSON error (`Content-Type: application/json`, an `error`).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        body = response.read()
    assert response.getheader("Content-Type") == "application/json", f"{response.status} {body[:300]!r}"
    error = json.loads(body)
    assert isinstance(error.get("error"), str), error
    return response.status, error


def test_a_request_line_over_the_limit_answers_a_json_414_naming_the_limit(api_port: int) -> None:
    status, body = send_raw(api_port, b"GET /v1/models?name=" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")

    assert status == 414
    assert "longer than 4094 bytes; send large inputs in the body" in body["error"]


def test_a_header_over_the_size_limit_answers_a_json_431_naming_the_limit(api_port: int) -> None:
    status, body = send_raw(api_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n")

    assert status == 431
    assert "at most 8190 bytes each" in body["error"]


def test_too_many_headers_answer_a_json_431_naming_the_limit(api_port: int) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(120))
    status, body = send_raw(api_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")

    assert status == 431
    assert "at most 100 header fields" in body["error"]


@pytest.mark.parametrize(("request_bytes", "expected"), [
    (b"GARBAGE\r\n\r\n", "send 'METHOD /path HTTP/1.1'"),
    (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", "HTTP version '9.9' is not supported"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: v\r\n\r\n", "'Bad Header' is not a valid header name"),
])
def test_a_malformed_request_answers_a_json_400_saying_what_to_send(api_port: int, request_bytes: bytes,
                                                                   expected: str) -> None:
    status, body = send_raw(api_port, request_bytes)

    assert status == 400
    assert expected in body["error"]
    assert body["code"] == "bad_request"


def test_an_error_gunicorn_does_not_blame_on_the_client_points_at_the_api_log() -> None:
    assert error_message(RuntimeError("boom"), 500, cfg=None) == "internal error (RuntimeError); see the API log"


@pytest.mark.parametrize(("chunks", "expected"), [
    (b"zz\r\nabc\r\n0\r\n\r\n", "InvalidChunkSize"),
    (b"3\r\nabcXX\r\n0\r\n\r\n", "ChunkMissingTerminator"),
])
def test_a_malformed_chunked_body_answers_a_json_400_not_a_500(api_port: int, api_key: str, chunks: bytes,
                                                                 expected: str) -> None:
    """gunicorn decodes chunks while the API reads the body, so the error reaches the API's code."""
    status, body = send_raw(api_port, b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                            + api_key.encode() + b"\r\nContent-Type: application/json\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n" + chunks)

    assert status == 400
    assert f"the request body could not be read ({expected}" in body["error"]
    assert "send it with Content-Length, or as valid HTTP/1.1 chunks" in body["error"]


def test_a_body_over_the_limit_from_the_python_client_reports_the_apis_413(api_port: int, api_key: str) -> None:
    client = ApiClient(f"http://127.0.0.1:{api_port}", api_key, timeout=30)

    with pytest.raises(ApiError) as refused:
        client.post("/v1/requests", {"model": "mlp", "inputs": {"x": "a" * (21 * 2**20)}})

    assert refused.value.http_status == 413, str(refused.value)
    assert "api.max_body_bytes" in str(refused.value)


def stalled_body(port: int, key: str) -> socket.socket:
    """A connection that sends a request's headers and 1 of its body's 100 bytes, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    return sock


def test_a_body_that_stops_arriving_is_a_json_408_and_stalled_clients_do_not_hold_the_api(
        api_port: int, api_key: str, api_settings: Settings) -> None:
    """Before, each such client held a request thread for as long as it kept its connection open: 40
    of them (the API has 2 x 16 threads) made even /healthz wait for ever."""
    stalled = [stalled_body(api_port, api_key) for _ in range(40)]
    try:
        began = time.monotonic()
        client = ApiClient(api_settings.api.public_url(), api_key, timeout=20)
        assert client.get("/healthz") == {"status": "ok"}
        assert time.monotonic() - began < 15  # the stalled bodies' threads came free after BODY_TIMEOUT

        first = stalled[0]
        response = http.client.HTTPResponse(first)
        response.begin()
        error = json.loads(response.read())
        assert response.status == 408 and error["code"] == "body_timeout", error
        assert "stopped arriving" in error["error"] and "Content-Length 100" in error["error"]
        assert first.recv(1) == b""  # and the connection is closed: the rest of its body is unknown
    finally:
        for sock in stalled:
            sock.close()


def test_clients_that_stall_a_body_the_api_answered_without_reading_do_not_hold_its_threads(
        api_port: int, api_settings: Settings) -> None:
    """A request without a key is a 401 before its body is read; gunicorn then drained the unread body
    for up to 5 s a connection before keep-alive, so 40 such clients made /healthz wait many seconds."""
    stalled = []
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", api_port), timeout=30)
            sock.sendall(b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b"{" * 10)
            stalled.append(sock)
        first = http.client.HTTPResponse(stalled[0])
        first.begin()
        assert first.status == 401
        began = time.monotonic()
        assert ApiClient(api_settings.api.public_url(), "none", timeout=20).get("/healthz") == {"status": "ok"}
        assert time.monotonic() - began < 2.5  # (was 5 s and more: every thread draining a stalled body)
    finally:
        for sock in stalled:
            sock.close()

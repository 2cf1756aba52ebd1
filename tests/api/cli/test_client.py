"""`ApiClient` against small real servers on 127.0.0.1: what it reports when a request cannot be sent whole."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from broker.state.embedded import free_port
from sits_api.cli.client import ApiClient, ApiError

BODY_CHARS = 16 * 2**20  # more than loopback socket buffers hold, so the client is still sending when the server closes


@pytest.fixture
def closes_after_headers() -> Iterator[str]:
    """A server that reads one request's headers, then closes without reading the body or answering."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = connection.recv(4096)
                if not chunk:
                    break
                received += chunk

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    thread.join(10)
    listener.close()


def test_a_server_closing_mid_body_without_an_answer_is_reported_as_a_body_too_large(closes_after_headers: str) -> None:
    client = ApiClient(closes_after_headers, "key", timeout=30)

    with pytest.raises(ApiError) as refused:
        client.post("/v1/requests", {"inputs": "a" * BODY_CHARS})

    message = str(refused.value)
    assert refused.value.http_status == 413, message
    assert f"the API closed the connection while {BODY_CHARS + 14} bytes of body were being sent" in message
    assert "api.max_body_bytes" in message and "send large inputs as files (jobs) or split them" in message


def test_a_refused_connection_still_says_the_api_cannot_be_reached() -> None:
    client = ApiClient(f"http://127.0.0.1:{free_port()}", "key", timeout=5)

    with pytest.raises(ApiError) as refused:
        client.post("/v1/requests", {"inputs": "a" * 1000})

    assert refused.value.http_status == 503
    assert "cannot reach the SITS API" in str(refused.value) and "sitsctl up" in str(refused.value)

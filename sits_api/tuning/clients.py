"""The sweep's clients: one-row requests over HTTP to the API, as a client of the fleet sends them.

Each client thread keeps one connection (HTTP/1.1 keep-alive) and sends `POST /v1/requests?wait=true`
with a sample row of the model's signature under the sweep's own key, so the latency it times is all a
client sees: the API's HTTP server, the intake, the queue, the batching and the run.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

import numpy as np

SEND_TIMEOUT_SECONDS = 60.0
"""The longest one request is waited for (the API's own `online.max_wait` answers before it)."""


class HttpSender:
    """Sends one-row requests of `model` to the API at `url` with `key`, one connection per client thread."""

    def __init__(self, url: str, key: str, model: str, feeds: list[Mapping[str, np.ndarray]]) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL of the API")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self._bodies = [json.dumps({"model": model, "inputs": {name: array.tolist() for name, array in feed.items()}})
                        .encode() for feed in feeds]
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def send(self, index: int) -> bool:
        """One request of client `index`, waited for: whether it was answered with outputs."""
        connection = self._connection()
        try:
            connection.request("POST", "/v1/requests?wait=true", body=self._bodies[index % len(self._bodies)],
                               headers=self._headers)
            answer = connection.getresponse()
            body: Any = json.loads(answer.read() or b"{}")
        except (OSError, http.client.HTTPException, ValueError):
            connection.close()  # (a fresh connection for the next one)
            return False
        return answer.status == 200 and isinstance(body, dict) and body.get("status") == "succeeded"

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            connection = kind(self._host, self._port, timeout=SEND_TIMEOUT_SECONDS)
            self._local.connection = connection
            with self._lock:
                self._opened.append(connection)
        return connection

    def close(self) -> None:
        """Close every connection the clients opened."""
        with self._lock:
            for connection in self._opened:
                connection.close()
            self._opened.clear()

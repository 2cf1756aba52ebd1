"""A small HTTP client for the SITS REST API (stdlib only), and where its URL and key come from.

Order: `SITS_API_URL` / `SITS_API_KEY`, then the files `sitsctl up` wrote
under `$SITS_HOME` (`api-url`, `api-key`).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.errors import SitsError


class ApiError(SitsError):
    """The API answered with an error; `http_status` and `message` are what it said."""

    def __init__(self, message: str, http_status: int) -> None:
        super().__init__(message)
        self.http_status = http_status


def sits_home(environ: Mapping[str, str] | None = None) -> Path:
    """`$SITS_HOME`, default `~/.sits`."""
    env = os.environ if environ is None else environ
    return Path(env.get("SITS_HOME") or "~/.sits").expanduser()


class ApiClient:
    """Calls the API with a bearer key; raises ApiError with the API's message on 4xx/5xx."""

    def __init__(self, url: str, key: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.timeout = timeout

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ApiClient:
        """The client for the stack `sitsctl up` started (or the one SITS_API_URL/KEY name)."""
        env = os.environ if environ is None else environ
        home = sits_home(env)
        url = env.get("SITS_API_URL") or _read(home / "api-url")
        key = env.get("SITS_API_KEY") or _read(home / "api-key")
        if not url:
            raise SitsError(f"no API to talk to: start one with `sitsctl up` or set SITS_API_URL (looked in {home})")
        return cls(url, key or "")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """JSON in, JSON out."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.key}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            payload = err.read()
            try:
                message = json.loads(payload).get("error") or payload.decode()
            except (ValueError, AttributeError):
                message = payload.decode(errors="replace") or err.reason
            raise ApiError(f"{err.code}: {message}", err.code) from err
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise ApiError(f"cannot reach the SITS API at {self.url}: {err}; is `sitsctl up` running?", 503) from err

    def get(self, path: str) -> Any:
        """GET `path`."""
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Any:
        """POST `body` to `path`."""
        return self.request("POST", path, body if body is not None else {})

    def delete(self, path: str) -> Any:
        """DELETE `path`."""
        return self.request("DELETE", path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None

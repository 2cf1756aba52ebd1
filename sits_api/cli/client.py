"""A small HTTP client for the SITS REST API (stdlib only), and where its URL and key come from.

Order: `SITS_API_URL` / `SITS_API_KEY`, then the files `sitsctl up` wrote
under `$SITS_HOME` (`api-url`, `api-key`).
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.errors import ConfigError, SitsError


class ApiError(SitsError):
    """The API answered with an error; `http_status` and `message` are what it said."""

    def __init__(self, message: str, http_status: int) -> None:
        super().__init__(message)
        self.http_status = http_status


def sits_home(environ: Mapping[str, str] | None = None) -> Path:
    """`$SITS_HOME`, else the `paths.home` of the config `$SITS_CONFIG` names (where a `sitsctl up` with
    that config records its URLs), else `~/.sits`."""
    env = os.environ if environ is None else environ
    if not env.get("SITS_HOME") and env.get("SITS_CONFIG"):
        from broker.config.loading import load_settings  # (pydantic and yaml: only when a config is named)

        return load_settings(environ=env).paths.home
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
        url = env.get("SITS_API_URL")
        source = "SITS_API_URL"
        if not url:
            url, source = recorded(home, "api-url"), str(home / "api-url")
        key = env.get("SITS_API_KEY") or _read(home / "api-key")
        if not url:
            left = " (its api-url is left from a stack that no longer runs)" if (home / "api-url").exists() else ""
            raise SitsError(f"no API to talk to: start one with `sitsctl up` or set SITS_API_URL (looked in "
                            f"{home}{left})")
        check_api_url(url, source)
        return cls(url, key or "")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """JSON in, JSON out."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.key}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with _opener().open(req, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as err:
            payload = err.read()
            try:
                message = json.loads(payload).get("error") or payload.decode()
            except (ValueError, AttributeError):
                message = payload.decode(errors="replace") or err.reason
            raise ApiError(f"{err.code}: {message}", err.code) from err
        except _AnswerLost as err:
            raise ApiError(f"the API closed the connection while {len(data or b'')} bytes of body were being sent; "
                           "the body is probably larger than the server accepts (api.max_body_bytes): send large "
                           "inputs as files (jobs) or split them", 413) from err
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise ApiError(f"cannot reach the SITS API at {self.url}: {err}; is `sitsctl up` running?", 503) from err
        except http.client.HTTPException as err:  # something answered, but not in HTTP
            raise ApiError(f"{self.url} did not answer as an HTTP server ({err!r}); is it the SITS API?", 502) from err
        try:
            return json.loads(payload or b"null")
        except ValueError as err:
            raise ApiError(f"{self.url}{path} answered with something that is not JSON; is it the SITS API?",
                           502) from err

    def get(self, path: str) -> Any:
        """GET `path`."""
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Any:
        """POST `body` to `path`."""
        return self.request("POST", path, body if body is not None else {})

    def delete(self, path: str) -> Any:
        """DELETE `path`."""
        return self.request("DELETE", path)


class _AnswerLost(ConnectionError):
    """The server closed the connection while the request was being sent, and left no answer to read."""


class _ReadsAnswerAfterSendFails(http.client.HTTPConnection):
    """An HTTPConnection that still reads the server's answer when sending a body fails with EPIPE/ECONNRESET.

    A server that refuses a request by its headers (a 413 over `api.max_body_bytes`) answers and closes
    without reading the body, so the client's next write fails; urllib would report that as an
    unreachable server and drop the answer waiting in the socket. Failures before the connection is
    made (refused, reset during the TLS handshake) and on requests without a body still raise.
    """

    _connected = False
    _send_error: OSError | None = None

    def connect(self) -> None:
        super().connect()
        self._connected = True

    def request(self, method: str, url: str, body: Any = None, headers: Mapping[str, Any] | None = None, *,
                encode_chunked: bool = False) -> None:
        try:
            super().request(method, url, body, headers or {}, encode_chunked=encode_chunked)
        except (BrokenPipeError, ConnectionResetError) as err:
            if not self._connected or not body:  # no answer to a body to read
                raise
            self._send_error = err

    def getresponse(self) -> http.client.HTTPResponse:
        try:
            return super().getresponse()
        except (OSError, http.client.HTTPException) as err:
            if self._send_error is None:
                raise
            raise _AnswerLost(str(self._send_error)) from err


class _ReadsAnswerAfterSendFailsHttps(_ReadsAnswerAfterSendFails, http.client.HTTPSConnection):
    """The HTTPS twin of `_ReadsAnswerAfterSendFails`."""


class _HttpHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_ReadsAnswerAfterSendFails, req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_ReadsAnswerAfterSendFailsHttps, req)  # the default context, as urlopen's


def _opener() -> urllib.request.OpenerDirector:
    """urlopen's opener with the handlers above; built per call, as it reads the proxy variables."""
    return urllib.request.build_opener(_HttpHandler, _HttpsHandler)


def check_api_url(url: str, source: str) -> None:
    """Raises ConfigError unless `url` is an http(s) URL with a host (and a valid port, if any)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        valid = parsed.scheme in ("http", "https") and bool(parsed.hostname)
        _ = parsed.port  # raises ValueError on a port that is not a number in 0-65535
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError(f"{source} {url!r} is not an API URL: give one like http://127.0.0.1:8000")


def segment(text: str) -> str:
    """`text` as one URL path segment, so a typed id with spaces gets the API's "not found" for it.

    A '/' is sent as %2F, but servers decode that before routing, so such an id still reaches another
    route (a 404 naming no id): the job commands refuse ids that cannot be one first (`params.JOB_ID`).
    """
    return urllib.parse.quote(text, safe="@")


def recorded(home: Path, name: str) -> str | None:
    """What `sitsctl up` recorded in `home/name` (`api-url`, `redis-url`) while its stack runs; None if
    nothing, or if no stack runs there now: a file left by a stack that was killed must not lead a
    command (and its key) to whatever server has taken that port since."""
    value = _read(home / name)
    return value if value and stack_runs(home) else None


def stack_lock(home: Path) -> Path:
    """The file a running stack holds a flock on: one stack per SITS_HOME (`Stack.start`)."""
    return home / "run" / "stack.lock"


def stack_runs(home: Path) -> bool:
    """Whether a `sitsctl up` (or demo) holds the stack lock of `home` now, i.e. its stack runs."""
    try:
        with open(stack_lock(home), "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(lock, fcntl.LOCK_UN)
            return False
    except OSError:  # no run folder: no stack ever ran here
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None

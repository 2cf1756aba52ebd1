"""The API's gunicorn worker: gthread, answering the requests gunicorn itself refuses in JSON.

gunicorn refuses some requests before Flask sees them (a request line over `limit_request_line`,
too many or too large headers, a malformed request line, header or chunked body) and answers those
with an HTML page. This worker keeps gunicorn's decisions (status code, logs, access log) and sends
the API's error body instead: `{"error": "<what to fix>", "code": "..."}`, as `sits_api.http.error_replies`
builds it for the app's own errors.

Selected with `--worker-class sits_api.http.gunicorn_worker.JsonErrorThreadWorker`
(`sits_api.cli.stack.api_command`, compose.yaml).
"""

from __future__ import annotations

import json
import time
from typing import Any

from gunicorn import util
from gunicorn.http.errors import (
    ChunkMissingTerminator,
    ExpectationFailed,
    InvalidChunkExtension,
    InvalidChunkSize,
    InvalidHeader,
    InvalidHeaderName,
    InvalidHTTPVersion,
    InvalidRequestLine,
    InvalidRequestMethod,
    LimitRequestHeaders,
    LimitRequestLine,
    ObsoleteFolding,
    UnsupportedTransferCoding,
)
from gunicorn.workers.gthread import ThreadWorker
from werkzeug.http import HTTP_STATUS_CODES

SHOWN_CHARS = 80
"""Client text quoted back in a message is cut to this many characters (a refused line may be 8 KiB)."""


UNREAD_BODY_DRAIN_SECONDS = 0.1
"""How long a thread drains a body its request left unread (answered before the view read it: a 401, a
415) before it closes the connection instead. gunicorn waits 5 s, so clients that send headers, get
their 401 and then stall the body held every request thread for seconds on end."""


class JsonErrorThreadWorker(ThreadWorker):
    """gunicorn's gthread worker whose error responses are the API's JSON error body, and which keeps a
    connection alive after a request that left its body unread only if the rest of it is there at once."""

    def _keepalive_after(self, conn: Any, keepalive: bool) -> bool:
        """gunicorn's (27) drain of an unread body before keep-alive, bounded by `UNREAD_BODY_DRAIN_SECONDS`
        instead of 5 s: past it the connection closes (a client then reconnects), as gunicorn does when its
        own bound runs out. A request whose view read its body (`content_encoding`) drains nothing."""
        if not keepalive:
            return False
        return bool(conn.parser.finish_body(deadline=time.monotonic() + UNREAD_BODY_DRAIN_SECONDS))

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """Let gunicorn classify, log and access-log the error, then send its status with a JSON body.

        gunicorn writes its HTML page to the socket it is given, so it is given a stand-in that keeps
        the page; only the status code is taken from it.
        """
        page = _HeldPage()
        super().handle_error(req, page, addr, exc)
        status = page.status_code()
        if status is None:  # gunicorn wrote nothing: there is nothing to answer
            return
        try:
            util.write_nonblock(client, error_response(status, error_message(exc, status, self.cfg)))
        except Exception:  # the client is gone; gunicorn ignores this the same way
            self.log.debug("Failed to send error message.")


class _HeldPage:
    """Takes the place of the client socket while gunicorn writes its error page, and keeps it."""

    def __init__(self) -> None:
        self.data = b""

    def gettimeout(self) -> float | None:
        return None

    def setblocking(self, flag: bool) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.data += data

    def status_code(self) -> int | None:
        """The status of the page's first line (`HTTP/1.1 414 URI Too Long`), None without one."""
        parts = self.data.split(b"\r\n", 1)[0].split(b" ", 2)
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def error_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response closing the connection: `status`, the API's JSON error body."""
    reason = HTTP_STATUS_CODES.get(status, "Error")
    body = json.dumps({"error": message, "code": reason.lower().replace(" ", "_")}, separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


def error_message(exc: BaseException, status: int, cfg: Any) -> str:
    """What was wrong with a request gunicorn refused with `status`, and what to send instead.

    `cfg` is gunicorn's configuration (its `limit_request_*` settings are the limits quoted).
    """
    if status >= 500 and not isinstance(exc, UnsupportedTransferCoding):
        return f"internal error ({type(exc).__name__}); see the API log"
    if isinstance(exc, LimitRequestLine):
        limit = exc.max_size or cfg.limit_request_line
        return (f"the request line (method, URL and HTTP version) is longer than {limit} bytes; "
                "send large inputs in the body, not in the URL")
    if isinstance(exc, LimitRequestHeaders):
        return (f"the request headers are too large ({exc}): at most {cfg.limit_request_fields} header fields "
                f"of at most {cfg.limit_request_field_size} bytes each; send large inputs in the body")
    if isinstance(exc, InvalidRequestLine):
        return f"the request line {_shown(exc.req)} is not valid HTTP; send 'METHOD /path HTTP/1.1'"
    if isinstance(exc, InvalidRequestMethod):
        return f"{_shown(exc.method)} is not a valid HTTP method; send an uppercase method such as GET or POST"
    if isinstance(exc, InvalidHTTPVersion):
        version = ".".join(map(str, exc.version)) if isinstance(exc.version, tuple) else exc.version
        return f"HTTP version {_shown(version)} is not supported; send HTTP/1.1 or HTTP/1.0"
    if isinstance(exc, ObsoleteFolding):
        return f"header {_shown(exc.hdr)} is folded over several lines; send each header on one line"
    if isinstance(exc, InvalidHeaderName):
        return (f"{_shown(exc.hdr)} is not a valid header name; send 'Name: value' lines whose names are "
                "letters, digits and -")
    if isinstance(exc, InvalidHeader):
        return (f"header {_shown(exc.hdr)} is not valid; send 'Name: value' lines, at most one Content-Length "
                "and no Transfer-Encoding but chunked")
    if isinstance(exc, UnsupportedTransferCoding):
        return (f"transfer coding {_shown(exc.hdr)} is not supported; send the body with Content-Length "
                "or Transfer-Encoding: chunked")
    if isinstance(exc, InvalidChunkSize | ChunkMissingTerminator | InvalidChunkExtension):
        return f"the chunked body is malformed ({exc}); send it with Content-Length, or as valid HTTP/1.1 chunks"
    if isinstance(exc, ExpectationFailed):
        return f"cannot meet Expect: {_shown(exc.expect)}; send 'Expect: 100-continue' or no Expect header"
    return f"the server refused the request: {exc}"


def _shown(value: object) -> str:
    """`value` quoted for a message, cut to SHOWN_CHARS characters."""
    text = str(value)
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")

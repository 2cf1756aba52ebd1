"""Every error as a JSON reply with its HTTP status, in one place.

A `SitsError` carries its own status and code; Flask's own errors (no route, a wrong method, a body
over `api.max_body_bytes`) get a message that says what to fix; anything else is logged and is the
one 500, which a client should never see.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from broker.errors import PayloadTooLarge, SitsError

log = logging.getLogger(__name__)


def sits_error(err: SitsError) -> Any:
    """A SitsError as its JSON body and HTTP status; a 429 says when to come back."""
    retry_after = getattr(err, "retry_after", None)  # a full queue's 429 (QueueFull) says when to come back
    return jsonify(err.to_dict()), err.http_status, ({"Retry-After": str(retry_after)} if retry_after else {})


def http_error(err: HTTPException) -> Any:
    """Flask's own errors (no route, wrong method, body too large) as JSON that says what to do."""
    if err.code == 413:
        limit = current_app.config["MAX_CONTENT_LENGTH"]  # api.max_body_bytes
        return sits_error(PayloadTooLarge(f"request body is larger than the {limit}-byte limit (api.max_body_bytes)"))
    code = err.name.lower().replace(" ", "_")
    if err.code == 404 and request.url_rule is None:  # no route matched (not a handler's own 404)
        return jsonify({"error": f"no API route for {request.method} {request.path}: an id is one path segment, and "
                                 "a '/' in it (even sent as %2F) makes another path; the routes are listed in "
                                 "GET /openapi.json", "code": code}), 404
    if err.code == 405:
        allowed = ", ".join(sorted(set(getattr(err, "valid_methods", None) or ()) - {"HEAD", "OPTIONS"}))
        return jsonify({"error": f"{request.path} does not take {request.method}; it takes {allowed or 'no method'}",
                        "code": code}), 405, ({"Allow": allowed} if allowed else {})
    return jsonify({"error": f"{err.name}: {err.description}", "code": code}), err.code


def unexpected_error(err: Exception) -> Any:
    """Anything else: logged with its traceback, answered as a 500 that names only its type."""
    log.exception("unexpected error on %s %s", request.method, request.path)
    return jsonify({"error": f"internal error ({type(err).__name__}); see the API log", "code": "internal_error"}), 500

"""Every SitsError as a gRPC status, in one place: the HTTP status it carries picks the code, and its
message is the HTTP answer's, word for word."""

from __future__ import annotations

import grpc

from broker.errors import SitsError

CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
         408: grpc.StatusCode.DEADLINE_EXCEEDED, 409: grpc.StatusCode.FAILED_PRECONDITION,
         413: grpc.StatusCode.RESOURCE_EXHAUSTED, 422: grpc.StatusCode.INVALID_ARGUMENT,
         429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}
"""HTTP status -> gRPC code, as gRPC's own HTTP mapping has them (a 500 and anything unlisted: INTERNAL)."""


def status_of(err: SitsError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(code, details, trailing metadata) of `err`. A refusal that says when to come back (a full
    queue's 429) carries it as `retry-after` (seconds, as HTTP's header) and `grpc-retry-pushback-ms`
    (what gRPC's own retry policy reads)."""
    retry_after = getattr(err, "retry_after", None)
    trailing = (("retry-after", str(retry_after)), ("grpc-retry-pushback-ms", str(retry_after * 1000))) \
        if retry_after else ()
    return CODES.get(err.http_status, grpc.StatusCode.INTERNAL), err.message, trailing

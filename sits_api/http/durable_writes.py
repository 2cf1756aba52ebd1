"""Acknowledging a write only once Redis's replicas hold it (`redis.wait_replicas`).

Redis replicates asynchronously: a failover promotes a replica that may lack the primary's last writes.
Most of what is lost then is found again from leases and checkpoints (docs/operations.md, "Redis
Sentinel"). What a client was told is stored, nothing in SITS can rebuild: a job it was given an id for
(201), a request queued for it (202), a cancel, a key, a tenant, a policy. So such an answer waits for
Redis's WAIT first, and is a retryable 503 when too few replicas confirmed the write in time: the write
may still be there (a job's output folder then answers a second submit 409, naming it), or may be lost.
An answer that carries its result (an inference, an analysis: 200 to a POST) and every refusal go as
they are.
"""

from __future__ import annotations

from collections.abc import Callable

from flask import Response, make_response, request

from broker.errors import SitsError, StoreBusy
from broker.state.settings import RedisSettings
from broker.state.store import Store
from sits_api.http import error_replies


def acknowledges_a_write(method: str, status: int) -> bool:
    """Whether an answer of `status` to `method` tells the client that something is stored: a POST
    answered 201 or 202, or a PUT, PATCH or DELETE answered 2xx."""
    if method == "POST":
        return status in (201, 202)
    return method in ("PUT", "PATCH", "DELETE") and 200 <= status < 300


def replica_wait(settings: RedisSettings, store: Store) -> Callable[[Response], Response]:
    """Flask's `after_request` hook (`create_app`): an answer that acknowledges a write goes once
    `redis.wait_replicas` replicas hold it; else a 503 that says so (or the error Redis gave)."""
    replicas, timeout = settings.wait_replicas, settings.wait_timeout

    def wait_for_replicas(response: Response) -> Response:
        if not replicas or not acknowledges_a_write(request.method, response.status_code):
            return response
        try:
            held = store.wait_for_replicas(replicas, timeout)
            if held < replicas:
                raise StoreBusy(f"Redis took the write, but {held} of the {replicas} replicas asked for "
                                f"(redis.wait_replicas) confirmed it within {timeout:g} s: a failover now could "
                                "lose it; look for it (GET) before you send it again")
        except SitsError as err:
            return make_response(error_replies.sits_error(err))
        return response

    return wait_for_replicas

"""Who is calling: the bearer key of each request, checked against Redis and trusted a few seconds
per process, and what its role lets it reach.

Runs before every route of v1 and v2 (`create_app` registers it). A route in `PUBLIC_ENDPOINTS`
needs no key; a `metrics` key reaches only `METRICS_ENDPOINTS`; a `viewer` key only reads.
"""

from __future__ import annotations

from flask import g, request

from broker.errors import Forbidden
from broker.state.store import Store
from sits_api.tenancy.known_keys import KnownKeys

PUBLIC_ENDPOINTS = {"health.healthz", "health.readyz", "health.openapi", "v2.live", "v2.ready", "v2.server_metadata"}
"""The routes any caller reaches without a key: health and the API's own description."""


def check_key(store: Store, known_keys: KnownKeys) -> None:
    """Set `g.identity` from the request's bearer key (checked against `store`, or trusted from
    `known_keys` for `known_keys.KEY_CACHE_SECONDS`); Unauthorized or Forbidden when it may not call this
    route."""
    if request.endpoint is None or request.endpoint in PUBLIC_ENDPOINTS:
        return  # no such route (a 404 follows), or a health/description endpoint
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    key = credentials.strip() if scheme.lower() == "bearer" else None  # schemes are case-insensitive
    g.identity = known_keys.identity(store, key)
    refuse_a_metrics_key_elsewhere()


METRICS_ENDPOINTS = frozenset({"health.prometheus_metrics", "v2.model_statistics"})
"""What a `metrics` key may read: GET /metrics and the v2 statistics."""


def refuse_a_metrics_key_elsewhere() -> None:
    """A `metrics` key (a Prometheus scrape's, a statistics reader's) reads `METRICS_ENDPOINTS` and nothing
    else; a `viewer` key reads (GET) and changes nothing."""
    if g.identity.get("role") == "metrics" and request.endpoint not in METRICS_ENDPOINTS:
        raise Forbidden(f"key '{g.identity.get('name')}' has the 'metrics' role: it may only read GET /metrics "
                        "and the v2 model statistics (GET /v2/models/stats)")
    if g.identity.get("role") == "viewer" and request.method not in ("GET", "HEAD"):
        raise Forbidden(f"key '{g.identity.get('name')}' has the 'viewer' role: it reads its tenant's work and "
                        "submits or changes nothing; use a key with the 'user' role")

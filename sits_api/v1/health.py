"""Health and monitoring: liveness, readiness, the OpenAPI document, the status overview, and
Prometheus metrics."""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, g, jsonify, request

from broker.errors import SitsError
from broker.failures import breaker
from broker.jobs import lists as job_lists
from broker.queueing import queues, tickets, workers
from broker.state.embedded import masked_url
from broker.tenants.apikeys import require_role
from sits_api import metrics
from sits_api.openapi import openapi_document
from sits_api.state import app_state

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
def healthz() -> Any:
    """Liveness: the process answers."""
    return jsonify({"status": "ok"})


@blueprint.get("/readyz")
def readyz() -> Any:
    """Readiness: Redis answers; reports how many workers are alive."""
    state = app_state()
    try:
        state.store.ping()
    except SitsError as err:
        return jsonify({"status": "unavailable", "error": err.message}), 503
    alive = [w for w in workers.list_workers(state.store, now=time.time(),
                                             timeout=state.settings.scheduler.worker_heartbeat_timeout) if w["alive"]]
    return jsonify({"status": "ready", "workers_alive": len(alive)})


@blueprint.get("/openapi.json")
def openapi() -> Any:
    """The OpenAPI 3 description of this API."""
    return jsonify(openapi_document())


@blueprint.get("/v1/status")
def status() -> Any:
    """The whole system at a glance: workers, queue depths, jobs by status, circuit breakers.

    Counts only, no job or request ids or owners, so any key but a `metrics` key may read it; the
    Redis URL only an admin key, and never its password (masked).
    """
    state = app_state()
    store, settings, now = state.store, state.settings, time.time()
    overview = {
        "api_url": settings.api.public_url(),
        "grpc_address": settings.api.grpc_address() or None,
        "redis_url": masked_url(settings.redis.url),
        "policy": settings.scheduler.policy,
        "workers": workers.list_workers(store, now=now, timeout=settings.scheduler.worker_heartbeat_timeout),
        "queues": queues.queue_depths(store),
        "tickets": tickets.ticket_count(store),
        "jobs": job_lists.count_jobs_by_status(store),
        "breakers": breaker.list_breakers(store, settings.breaker, now=now,
                                          heartbeat_timeout=settings.scheduler.worker_heartbeat_timeout),
    }
    if g.identity.get("role") != "admin":
        del overview["redis_url"]
    return jsonify(overview)


@blueprint.get("/metrics")
def prometheus_metrics() -> Any:
    """Prometheus metrics (queues, workers, memory, jobs by status, requests and rows served), read from
    Redis at each scrape. Counts only, but of every tenant's work: `metrics` keys and admins read them."""
    require_role(g.identity, "metrics")
    body, content_type = metrics.exposition(app_state().metrics, request.headers.get("Accept", ""))
    return Response(body, content_type=content_type)

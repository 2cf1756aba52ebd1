"""Health and monitoring: liveness, readiness, the OpenAPI document, the status overview, and
Prometheus metrics."""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, g, jsonify, request

from broker.errors import SitsError
from broker.failures import breaker
from broker.jobs import lists as job_lists
from broker.models import registry
from broker.queueing import queues, tickets, workers
from broker.state.embedded import masked_url
from broker.tenants.apikeys import key_tenant, require_role
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
    Redis URL only an admin key, and never its password (masked). An admin sees every model and job; a
    tenant's key the models its tenant owns or no tenant owns (shared), and its tenant's jobs
    (`_tenant_view`): how much another tenant's models are used is that tenant's own.
    """
    state = app_state()
    store, settings, now = state.store, state.settings, time.time()
    admin = g.identity.get("role") == "admin"
    overview = {
        "api_url": settings.api.public_url(),
        "grpc_address": settings.api.grpc_address() or None,
        "redis_url": masked_url(settings.redis.url),
        "policy": settings.scheduler.policy,
        "workers": workers.list_workers(store, now=now, timeout=settings.scheduler.worker_heartbeat_timeout),
        "queues": queues.queue_depths(store),
        "tickets": tickets.ticket_count(store),
        "jobs": job_lists.count_jobs_by_status(store) if admin else job_lists.count_tenant_jobs_by_status(
            store, key_tenant(g.identity), newest=TENANT_JOBS_COUNTED),
        "breakers": breaker.list_breakers(store, settings.breaker, now=now,
                                          heartbeat_timeout=settings.scheduler.worker_heartbeat_timeout),
    }
    if not admin:
        del overview["redis_url"]
        overview = _tenant_view(store, overview, key_tenant(g.identity))
    return jsonify(overview)


TENANT_JOBS_COUNTED = 1000
"""The newest jobs of a tenant its status counts (`_tenant_view`): a call stays small however many it kept."""


def _tenant_view(store: Any, overview: dict[str, Any], tenant: str) -> dict[str, Any]:
    """`overview` as a key of `tenant` sees it: queues, breakers, loaded models and OOM ceilings of the
    models its tenant owns or no tenant owns."""
    owners = registry.model_owners(store)

    def shown(ref: str) -> bool:
        return owners.get(ref.partition("@")[0]) in (None, tenant)

    def worker_view(worker: dict[str, Any]) -> dict[str, Any]:
        seen = dict(worker)
        if "models_loaded" in seen:
            seen["models_loaded"] = [ref for ref in seen["models_loaded"] or [] if shown(ref)]
        oom = seen.get("oom")
        if isinstance(oom, dict) and isinstance(oom.get("ceilings"), dict):
            seen["oom"] = {**oom, "ceilings": {ref: rows for ref, rows in oom["ceilings"].items() if shown(ref)}}
        return seen

    return {**overview,
            "queues": {ref: depth for ref, depth in overview["queues"].items() if shown(ref)},
            "breakers": [entry for entry in overview["breakers"] if shown(str(entry.get("model", "")))],
            "workers": [worker_view(worker) for worker in overview["workers"]]}


@blueprint.get("/metrics")
def prometheus_metrics() -> Any:
    """Prometheus metrics (queues, workers, memory, jobs by status, requests and rows served), read from
    Redis at each scrape. Counts only, but of every tenant's work: `metrics` keys and admins read them."""
    require_role(g.identity, "metrics")
    body, content_type = metrics.exposition(app_state().metrics, request.headers.get("Accept", ""))
    return Response(body, content_type=content_type)

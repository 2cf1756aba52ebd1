"""The Flask app: REST endpoints for jobs and models, health, OpenAPI, and bearer-key auth.

Views are thin: parse the body with pydantic, call a function of
`sits_api.services` or `broker`, return JSON. Every `SitsError` becomes a
JSON error with its HTTP status in one handler; nothing the client does
can produce a 500.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Blueprint, Flask, Response, g, jsonify, request
from pydantic import BaseModel, ValidationError
from werkzeug.exceptions import HTTPException

from broker.config.settings import Settings
from broker.errors import BadInput, Forbidden, PayloadTooLarge, SitsError
from broker.failures import breaker
from broker.jobs import lists as job_lists
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.models import registry
from broker.online import requests
from broker.queueing import policy, queues, workers
from broker.sla.task_sets import TaskSet
from broker.state.store import Store
from broker.tenants.apikeys import authenticate, may_read, owns, require_role
from broker.tenants.records import TenantTable
from broker.tenants.settings import Tenant
from sits_api import ab_routes, metrics, request_intake, services, sla, tenant_gate
from sits_api.jsonio import OrjsonProvider, request_object
from sits_api.openapi import openapi_document
from sits_api.result_inbox import ResultInbox
from sits_api.schemas import MAX_JOBS_LISTED, JobSubmission, ModelRegistration, OnlineRequest
from sits_api.task_sender import Dispatcher
from sits_api.v2 import v2

log = logging.getLogger(__name__)

KEY_CACHE_SECONDS = 5.0
"""A key that passed is trusted this long per API process (a revoked key stops working within it)."""

PUBLIC_ENDPOINTS = {"api.healthz", "api.readyz", "api.openapi", "v2.live", "v2.ready", "v2.server_metadata"}

api = Blueprint("api", __name__)


def create_app(settings: Settings, store: Store | None = None, dispatcher: Dispatcher | None = None) -> Flask:
    """The API app over the Redis named in `settings` (or the `store` given)."""
    app = Flask("sits_api")
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_body_bytes
    app.config["SITS_BODY_TIMEOUT"] = settings.api.body_timeout
    app.json = OrjsonProvider(app)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    store = store or Store.connect(settings.redis.url, settings.redis.key_prefix)
    app.extensions["sits"] = {
        "settings": settings,
        "store": store,
        "dispatcher": dispatcher or Dispatcher(settings, store),
        "policy": policy.LivePolicy(store, default=policy.default_ordering(settings.scheduler.policy)),
        "inbox": ResultInbox(store),
        "known_keys": {},
        "metrics": metrics.SitsCollector(store, settings),
        "tenants": TenantTable(settings.tenants),
    }
    app.before_request(_authenticate)  # every blueprint: v1 and the v2 protocol
    app.register_blueprint(api)
    app.register_blueprint(v2)
    app.register_error_handler(SitsError, _sits_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected_error)
    return app


def _ctx() -> dict[str, Any]:
    from flask import current_app

    return current_app.extensions["sits"]


def _parse(model: type[BaseModel]) -> Any:
    body = request_object("a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
            f"{'unknown field' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in err.errors()
        )
        raise BadInput(f"invalid {model.__name__}: {problems}") from err


# --- errors ---------------------------------------------------------------------------


def _sits_error(err: SitsError) -> Any:
    retry_after = getattr(err, "retry_after", None)  # a full queue's 429 (QueueFull) says when to come back
    return jsonify(err.to_dict()), err.http_status, ({"Retry-After": str(retry_after)} if retry_after else {})


def _http_error(err: HTTPException) -> Any:
    if err.code == 413:
        limit = _ctx()["settings"].api.max_body_bytes
        return _sits_error(PayloadTooLarge(f"request body is larger than the {limit}-byte limit (api.max_body_bytes)"))
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


def _unexpected_error(err: Exception) -> Any:
    log.exception("unexpected error on %s %s", request.method, request.path)
    return jsonify({"error": f"internal error ({type(err).__name__}); see the API log", "code": "internal_error"}), 500


# --- auth ---------------------------------------------------------------------------


def _authenticate() -> None:
    if request.endpoint is None or request.endpoint in PUBLIC_ENDPOINTS:
        return  # no such route (a 404 follows), or a health/description endpoint
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    key = credentials.strip() if scheme.lower() == "bearer" else None  # schemes are case-insensitive
    known = _ctx()["known_keys"]
    cached = known.get(key) if key else None
    if cached and time.monotonic() - cached[0] < KEY_CACHE_SECONDS:
        g.identity = cached[1]
        _refuse_a_metrics_key_elsewhere()
        return
    g.identity = authenticate(_ctx()["store"], key)
    known[key] = (time.monotonic(), g.identity)
    _refuse_a_metrics_key_elsewhere()


METRICS_ENDPOINTS = frozenset({"api.prometheus_metrics", "v2.model_statistics"})
"""What a `metrics` key may read: GET /metrics and the v2 statistics."""


def _refuse_a_metrics_key_elsewhere() -> None:
    """A `metrics` key (a Prometheus scrape's, a statistics reader's) reads `METRICS_ENDPOINTS` and nothing
    else; a `viewer` key reads (GET) and changes nothing."""
    if g.identity.get("role") == "metrics" and request.endpoint not in METRICS_ENDPOINTS:
        raise Forbidden(f"key '{g.identity.get('name')}' has the 'metrics' role: it may only read GET /metrics "
                        "and the v2 model statistics (GET /v2/models/stats)")
    if g.identity.get("role") == "viewer" and request.method not in ("GET", "HEAD"):
        raise Forbidden(f"key '{g.identity.get('name')}' has the 'viewer' role: it reads its tenant's work and "
                        "submits or changes nothing; use a key with the 'user' role")


def _visible_to_caller(record: dict[str, Any], not_found: SitsError, *, steer: bool = False) -> dict[str, Any]:
    """`record` (a job or a request) if the caller's key may read it (`apikeys.may_read`), or with `steer`
    cancel, stop or resume it (`apikeys.owns`), else `not_found`: the very error an unknown id gets, so
    that no tenant learns that another's ids exist (a viewer of the tenant gets a 403 when steering)."""
    if steer and may_read(g.identity, record["owner"], record.get("tenant")) \
            and not owns(g.identity, record["owner"], record.get("tenant")):
        raise Forbidden(f"key '{g.identity.get('name')}' has the '{g.identity.get('role')}' role: it may read its "
                        "tenant's work, not steer it")
    if not may_read(g.identity, record["owner"], record.get("tenant")):
        raise not_found
    return record


def _model_as_seen(record: dict[str, Any]) -> dict[str, Any]:
    """A model record as the caller may see it: to the keys that own its name (`apikeys.owns`: the
    tenant's keys, admins) whole; to other keys with `owner` None (as for a name no tenant owns) and
    the file paths None too, the registered `source_path` (which names folders of the registrant's,
    often the tenant itself), the stored copy's `path` and a fused graph's, so that no tenant learns
    another's name or files. Any key may use the model either way."""
    if owns(g.identity, record.get("owner")):
        return record
    hidden = record | {"owner": None, "path": None, "source_path": None}
    if isinstance(record.get("fusion"), dict):
        hidden["fusion"] = record["fusion"] | {"path": None}
    return hidden


def _caller_job(job_id: str, *, steer: bool = False) -> dict[str, Any]:
    """The job `job_id`, if the caller may see it (with `steer`: and steer it); JobNotFound otherwise."""
    return _visible_to_caller(jobs.get_job(_ctx()["store"], job_id, now=time.time()), jobs.job_not_found(job_id),
                              steer=steer)


# --- health -------------------------------------------------------------------------


@api.get("/healthz")
def healthz() -> Any:
    """Liveness: the process answers."""
    return jsonify({"status": "ok"})


@api.get("/readyz")
def readyz() -> Any:
    """Readiness: Redis answers; reports how many workers are alive."""
    ctx = _ctx()
    try:
        ctx["store"].ping()
    except SitsError as err:
        return jsonify({"status": "unavailable", "error": err.message}), 503
    alive = [w for w in workers.list_workers(ctx["store"], now=time.time(),
                                             timeout=ctx["settings"].scheduler.worker_heartbeat_timeout) if w["alive"]]
    return jsonify({"status": "ready", "workers_alive": len(alive)})


@api.get("/openapi.json")
def openapi() -> Any:
    """The OpenAPI 3 description of this API."""
    return jsonify(openapi_document())


@api.get("/v1/status")
def status() -> Any:
    """The whole system at a glance: workers, queue depths, jobs by status, circuit breakers.

    Counts only, no job or request ids or owners, so any key may read it; the Redis URL (which
    may carry Redis's password) only an admin key.
    """
    ctx = _ctx()
    store, settings, now = ctx["store"], ctx["settings"], time.time()
    overview = {
        "api_url": settings.api.public_url(),
        "redis_url": settings.redis.url,
        "policy": settings.scheduler.policy,
        "workers": workers.list_workers(store, now=now, timeout=settings.scheduler.worker_heartbeat_timeout),
        "queues": queues.queue_depths(store),
        "tickets": queues.ticket_count(store),
        "jobs": job_lists.count_jobs_by_status(store),
        "breakers": breaker.list_breakers(store, settings.breaker, now=now,
                                          heartbeat_timeout=settings.scheduler.worker_heartbeat_timeout),
    }
    if g.identity.get("role") != "admin":
        del overview["redis_url"]
    return jsonify(overview)


@api.get("/metrics")
def prometheus_metrics() -> Any:
    """Prometheus metrics (queues, workers, memory, jobs by status, requests and rows served), read from
    Redis at each scrape. Counts only, but of every tenant's work: `metrics` keys and admins read them."""
    require_role(g.identity, "metrics")
    body, content_type = metrics.exposition(_ctx()["metrics"], request.headers.get("Accept", ""))
    return Response(body, content_type=content_type)


# --- models -------------------------------------------------------------------------


@api.post("/v1/models")
def register_model() -> Any:
    """Register an ONNX file (new version when its content changed) under a name that is new or the
    caller's tenant's (another tenant's is a 403)."""
    ctx = _ctx()
    body = _parse(ModelRegistration)
    record = services.register_model(ctx["settings"], ctx["store"], ctx["dispatcher"], body,
                                     registrant=g.identity, now=time.time())
    return jsonify(record), 201


@api.get("/v1/models")
def list_models() -> Any:
    """Every registered model version, with its name's `owner` and file paths to the keys that own it
    (`_model_as_seen`); any key may use any model."""
    return jsonify({"models": [_model_as_seen(record) for record in registry.list_model_versions(_ctx()["store"])]})


@api.get("/v1/models/<ref>")
def get_model(ref: str) -> Any:
    """One model: `name` (newest version, with the list of versions) or `name@version`, with the
    batching settings workers apply to it (`auto` values resolved from its profile)."""
    ctx = _ctx()
    store = ctx["store"]
    record = registry.get_model(store, ref)
    record = _model_as_seen(record)
    if "@" not in ref:
        record = record | {"versions": [v["version"] for v in registry.list_model_versions(store, record["name"])]}
    return jsonify(record | {"batching": services.model_batching(ctx["settings"], record).to_dict()})


# --- jobs ---------------------------------------------------------------------------


@api.post("/v1/jobs")
def submit_job() -> Any:
    """Submit an offline job; answers 201 with the job."""
    ctx = _ctx()
    body = _parse(JobSubmission)
    job = services.submit_job(ctx["settings"], ctx["store"], ctx["dispatcher"], body,
                              caller=g.identity, now=time.time(), headers=request.headers, tenants=ctx["tenants"])
    return jsonify(job), 201


@api.get("/v1/jobs")
def list_jobs() -> Any:
    """Newest jobs first; `?status=` filters, `?limit=` bounds (default 100).

    A user key lists only its own jobs (naming another `?owner=` is a 403); a tenant-admin or viewer
    key its tenant's; an admin key every job, jobs stored without an owner included, or with `?owner=`
    those of one key name.
    """
    try:
        limit = int(request.args.get("limit", 100))
    except ValueError as err:
        raise BadInput(f"limit must be a whole number from 1 to {MAX_JOBS_LISTED}") from err
    if not 1 <= limit <= MAX_JOBS_LISTED:
        raise BadInput(f"limit must be a whole number from 1 to {MAX_JOBS_LISTED}")
    status_filter = request.args.get("status") or None
    if status_filter and status_filter not in jobs.ACTIVE_STATUSES + jobs.FINAL_STATUSES:
        raise BadInput(f"status must be one of {', '.join(jobs.ACTIVE_STATUSES + jobs.FINAL_STATUSES)}")
    owner = request.args.get("owner")
    if owner is not None and not owner.strip():
        raise BadInput("owner must be the name of an API key, e.g. ?owner=alice; leave it out for every job")
    if g.identity.get("role") == "user":
        if owner not in (None, g.identity["name"]):
            raise Forbidden(f"key '{g.identity['name']}' may list only its own jobs; leave out owner= "
                            "(an admin key may name any owner)")
        owner = g.identity["name"]
    listed = job_lists.list_jobs(_ctx()["store"], now=time.time(), limit=limit, status=status_filter, owner=owner)
    # `may_read` decides; the owner filter above only spares reading other tenants' jobs
    return jsonify({"jobs": [job for job in listed if may_read(g.identity, job["owner"], job.get("tenant"))]})


@api.get("/v1/jobs/<job_id>")
def get_job(job_id: str) -> Any:
    """One job with progress, throughput and ETA."""
    return jsonify(_caller_job(job_id))


@api.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> Any:
    """Cancel a job: its waiting chunks leave the queue; a finished job keeps its status."""
    store = _ctx()["store"]
    _caller_job(job_id, steer=True)
    job_stops.stop_job(store, job_id, status="cancelled", error="cancelled by the user", now=time.time())
    return jsonify(jobs.get_job(store, job_id, now=time.time()))


@api.post("/v1/jobs/<job_id>/resume")
def resume_job(job_id: str) -> Any:
    """Re-queue only the chunks of a job that are not done."""
    ctx = _ctx()
    _caller_job(job_id, steer=True)
    job = services.resume_job(ctx["settings"], ctx["store"], ctx["dispatcher"], job_id, caller=g.identity,
                              now=time.time())
    return jsonify(job), 202


@api.post("/v1/sla/analysis")
def sla_analysis() -> Any:
    """Schedulability of a periodic task set: utilisation against the Liu-Layland bound, each task's
    response time, and whether all meet their deadlines (docs/sla.md)."""
    ctx = _ctx()
    return jsonify(sla.analyse_task_set(ctx["settings"], ctx["store"], _parse(TaskSet)))


# --- online requests ------------------------------------------------------------------


def _query_flag(name: str) -> bool:
    """A yes/no query parameter (`?wait=true`); BadInput for a value that is neither."""
    if not request.query_string:
        return False  # the usual case, without parsing the query into a MultiDict
    value = request.args.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise BadInput(f"query parameter '{name}' must be true or false, got {request.args.get(name)!r}")


def _priority(body: Any, tenant: Tenant | None) -> int:
    """The priority a request or job runs at: its own, else its tenant's `default_priority`, else the default."""
    if "priority" in body.model_fields_set or tenant is None or tenant.default_priority is None:
        return int(body.priority)
    return tenant.default_priority


@api.post("/v1/requests")
def submit_request() -> Any:
    """One inference request; 202 with its id, or with `wait` the result (200) when it is done in time."""
    ctx = _ctx()
    body = _parse(OnlineRequest)
    asked_in_query = _query_flag("wait")  # checked before anything is queued, whatever the body says
    wait = body.wait or asked_in_query
    settings, store = ctx["settings"], ctx["store"]
    request_id = requests.new_request_id()
    with ctx["inbox"].expecting(request_id, wait=wait) as answer:
        model = ab_routes.routed(store, body.model, g.identity, request.headers, "v1")
        tenant = tenant_gate.check_model(ctx["tenants"], store, g.identity, model)
        spec = request_intake.submit(settings, store, ctx["dispatcher"], ctx["policy"], model=model,
                                     inputs=body.inputs, priority=_priority(body, tenant),
                                     deadline_ms=body.deadline_ms, user_tier=body.user_tier, tokens=body.tokens,
                                     owner=g.identity["name"], now=time.time(), request_id=request_id,
                                     timeout_ms=body.timeout_ms, reply_to=answer.reply_to,
                                     tenant=tenant_gate.tenant_of(g.identity),
                                     max_queued=tenant.max_queued if tenant else 0)
        done = request_intake.wait_for_result(settings, store, ctx["policy"], answer, spec,
                                              seconds=request_intake.wait_seconds(settings, body.deadline_ms))
    if done:
        return jsonify(request_intake.to_json_result(done)), 200
    return jsonify({"id": spec.request_id, "status": "queued", "model": spec.model_name,
                    "model_version": spec.model_version}), 202


@api.get("/v1/requests/<request_id>")
def get_request(request_id: str) -> Any:
    """A request's status and, once done, its outputs (to the key that submitted it, or an admin)."""
    record = _visible_to_caller(requests.get_request(_ctx()["store"], request_id),
                                requests.request_not_found(request_id))
    return jsonify(request_intake.to_json_result(record))


@api.put("/v1/policy")
def update_policy() -> Any:
    """Admin: hot-update weights, thresholds or ordering; every waiting item is re-scored in slices."""
    require_role(g.identity, "admin")
    ctx = _ctx()
    body = request_object("a JSON object of policy keys, e.g. {\"alpha\": 0.5}")
    current, ordering = policy.get_policy(ctx["store"], default=policy.default_ordering(
        ctx["settings"].scheduler.policy))
    weights, ordering = policy.parse_policy_update(body, current, ordering)
    policy.save_policy(ctx["store"], weights, ordering)
    report = policy.rescore_all(ctx["store"], weights, ordering)
    return jsonify({"ordering": ordering, **weights.to_dict(), "rescore": report})


@api.get("/v1/routes")
def list_routes() -> Any:
    """Admin: the A/B routes of bare model names (docs/routing.md); tenant-admin: those of its tenant's models."""
    store = _ctx()["store"]
    if g.identity.get("role") != "tenant-admin":
        require_role(g.identity, "admin")
    routes = ab_routes.list_routes(store)
    return jsonify({"routes": [route for route in routes if tenant_gate.may_route(store, g.identity, route["model"])]})


@api.put("/v1/routes")
def put_route() -> Any:
    """Admin, or tenant-admin for its tenant's model names: set a model's A/B route (`split`, `groups`,
    `paths`); every API process follows it within a second."""
    body = request_object('a route, e.g. {"model": "convnet", "split": {"<version>": 0.8, "<version>": 0.2}}')
    store = _ctx()["store"]
    tenant_gate.check_route_access(store, g.identity, str(body.get("model", "")))
    return jsonify(ab_routes.put_route(store, body))


@api.delete("/v1/routes/<model>")
def delete_route(model: str) -> Any:
    """Admin, or tenant-admin for its tenant's model names: remove a model's route; its bare name runs on its
    newest version again."""
    tenant_gate.check_route_access(_ctx()["store"], g.identity, model)
    ab_routes.delete_route(_ctx()["store"], model)
    return "", 204


@api.get("/v1/tenants")
def list_tenants() -> Any:
    """Admin: every tenant with its share, limit and quotas (docs/tenants.md)."""
    require_role(g.identity, "admin")
    ctx = _ctx()
    return jsonify({"tenants": tenant_gate.list_tenants(ctx["tenants"], ctx["store"])})


@api.get("/v1/tenants/<name>")
def get_tenant(name: str) -> Any:
    """A tenant's record: to admins, and to its own tenant's keys."""
    if g.identity.get("role") != "admin" and tenant_gate.tenant_of(g.identity) != name:
        require_role(g.identity, "admin")
    ctx = _ctx()
    return jsonify(tenant_gate.get_tenant(ctx["tenants"], ctx["store"], name))


@api.put("/v1/tenants/<name>")
def put_tenant(name: str) -> Any:
    """Admin: create or replace a tenant's record; every process follows it within a second."""
    require_role(g.identity, "admin")
    ctx = _ctx()
    body = request_object('a tenant, e.g. {"guaranteed_share": 0.3, "limit": 3.0, "preemption_target": "200ms"}')
    return jsonify(tenant_gate.put_tenant(ctx["tenants"], ctx["store"], name, body))


@api.delete("/v1/tenants/<name>")
def delete_tenant(name: str) -> Any:
    """Admin: remove a tenant's record; its keys stay, with no share and no caps."""
    require_role(g.identity, "admin")
    ctx = _ctx()
    tenant_gate.delete_tenant(ctx["tenants"], ctx["store"], name)
    return "", 204


@api.post("/v1/keys")
def create_key() -> Any:
    """Admin or tenant-admin: make an API key (a tenant admin: of its own tenant); the key is answered once."""
    body = request_object('a key, e.g. {"name": "alice", "role": "user", "tenant": "acme"}')
    return jsonify(tenant_gate.create_key(_ctx()["store"], g.identity, body)), 201


@api.get("/v1/keys")
def list_keys() -> Any:
    """Admin: every key's name, role, tenant and group; tenant-admin: its tenant's. Never a key or digest."""
    return jsonify({"keys": tenant_gate.keys_visible(_ctx()["store"], g.identity)})


@api.delete("/v1/keys/<name>")
def revoke_keys(name: str) -> Any:
    """Admin or tenant-admin: delete the keys of that name; they stop working at once in this process,
    within 5 s in the others (each trusts a key it checked for that long)."""
    revoked = tenant_gate.revoke_keys(_ctx()["store"], g.identity, name)
    _ctx()["known_keys"].clear()
    return jsonify({"revoked": revoked})


@api.get("/v1/usage")
def get_usage() -> Any:
    """Chargeback: device-seconds, rows, requests, jobs, queue time and cost, per tenant (docs/tenants.md)."""
    ctx = _ctx()
    return jsonify(tenant_gate.usage(ctx["settings"], ctx["store"], g.identity, request.args, now=time.time()))


@api.get("/v1/policy")
def get_policy() -> Any:
    """The live scoring weights and queue ordering."""
    ctx = _ctx()
    weights, ordering = policy.get_policy(ctx["store"], default=policy.default_ordering(
        ctx["settings"].scheduler.policy))
    return jsonify({"ordering": ordering, **weights.to_dict()})

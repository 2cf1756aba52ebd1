"""Administration: the live policy, A/B routes, tenants, API keys and chargeback usage."""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, g, jsonify, request

from broker.queueing import policy
from broker.tenants.apikeys import require_role
from sits_api.http.jsonio import request_object
from sits_api.state import app_state
from sits_api.tenancy import ab_routes, tenant_gate

blueprint = Blueprint("admin", __name__)


@blueprint.get("/v1/policy")
def get_policy() -> Any:
    """The live scoring weights and queue ordering."""
    state = app_state()
    weights, ordering = policy.get_policy(state.store, default=policy.default_ordering(
        state.settings.scheduler.policy))
    return jsonify({"ordering": ordering, **weights.to_dict()})


@blueprint.put("/v1/policy")
def update_policy() -> Any:
    """Admin: hot-update weights, thresholds or ordering; every waiting item is re-scored in slices."""
    require_role(g.identity, "admin")
    state = app_state()
    body = request_object("a JSON object of policy keys, e.g. {\"alpha\": 0.5}")
    current, ordering = policy.get_policy(state.store, default=policy.default_ordering(
        state.settings.scheduler.policy))
    weights, ordering = policy.parse_policy_update(body, current, ordering)
    policy.save_policy(state.store, weights, ordering)
    report = policy.rescore_all(state.store, weights, ordering)
    return jsonify({"ordering": ordering, **weights.to_dict(), "rescore": report})


@blueprint.get("/v1/routes")
def list_routes() -> Any:
    """Admin: the A/B routes of bare model names (docs/routing.md); tenant-admin: those of its tenant's models."""
    store = app_state().store
    if g.identity.get("role") != "tenant-admin":
        require_role(g.identity, "admin")
    routes = ab_routes.list_routes(store)
    return jsonify({"routes": [route for route in routes if tenant_gate.may_route(store, g.identity, route["model"])]})


@blueprint.put("/v1/routes")
def put_route() -> Any:
    """Admin, or tenant-admin for its tenant's model names: set a model's A/B route (`split`, `groups`,
    `paths`); every API process follows it within a second."""
    body = request_object('a route, e.g. {"model": "convnet", "split": {"<version>": 0.8, "<version>": 0.2}}')
    store = app_state().store
    tenant_gate.check_route_access(store, g.identity, str(body.get("model", "")))
    return jsonify(ab_routes.put_route(store, body))


@blueprint.delete("/v1/routes/<model>")
def delete_route(model: str) -> Any:
    """Admin, or tenant-admin for its tenant's model names: remove a model's route; its bare name runs on its
    newest version again."""
    tenant_gate.check_route_access(app_state().store, g.identity, model)
    ab_routes.delete_route(app_state().store, model)
    return "", 204


@blueprint.get("/v1/tenants")
def list_tenants() -> Any:
    """Admin: every tenant with its share, limit and quotas (docs/tenants.md)."""
    require_role(g.identity, "admin")
    state = app_state()
    return jsonify({"tenants": tenant_gate.list_tenants(state.tenants, state.store)})


@blueprint.get("/v1/tenants/<name>")
def get_tenant(name: str) -> Any:
    """A tenant's record: to admins, and to its own tenant's keys."""
    if g.identity.get("role") != "admin" and tenant_gate.tenant_of(g.identity) != name:
        require_role(g.identity, "admin")
    state = app_state()
    return jsonify(tenant_gate.get_tenant(state.tenants, state.store, name))


@blueprint.put("/v1/tenants/<name>")
def put_tenant(name: str) -> Any:
    """Admin: create or replace a tenant's record; every process follows it within a second."""
    require_role(g.identity, "admin")
    state = app_state()
    body = request_object('a tenant, e.g. {"guaranteed_share": 0.3, "limit": 3.0, "preemption_target": "200ms"}')
    return jsonify(tenant_gate.put_tenant(state.tenants, state.store, name, body))


@blueprint.delete("/v1/tenants/<name>")
def delete_tenant(name: str) -> Any:
    """Admin: remove a tenant's record; its keys stay, with no share and no caps."""
    require_role(g.identity, "admin")
    state = app_state()
    tenant_gate.delete_tenant(state.tenants, state.store, name)
    return "", 204


@blueprint.post("/v1/keys")
def create_key() -> Any:
    """Admin or tenant-admin: make an API key (a tenant admin: of its own tenant); the key is answered once."""
    body = request_object('a key, e.g. {"name": "alice", "role": "user", "tenant": "acme"}')
    return jsonify(tenant_gate.create_key(app_state().store, g.identity, body)), 201


@blueprint.get("/v1/keys")
def list_keys() -> Any:
    """Admin: every key's name, role, tenant and group; tenant-admin: its tenant's. Never a key or digest."""
    return jsonify({"keys": tenant_gate.keys_visible(app_state().store, g.identity)})


@blueprint.delete("/v1/keys/<name>")
def revoke_keys(name: str) -> Any:
    """Admin or tenant-admin: delete the keys of that name (a tenant admin's: of its tenant; an admin's: of every
    tenant, or of the one `?tenant=` names); they stop working at once in this process, within 5 s in the others
    (each trusts a key it checked for that long)."""
    revoked, tenant = tenant_gate.revoke_keys(app_state().store, g.identity, name,
                                              (request.args.get("tenant") or "").strip() or None)
    app_state().known_keys.forget(name, tenant)
    return jsonify({"revoked": revoked})


@blueprint.get("/v1/usage")
def get_usage() -> Any:
    """Chargeback: device-seconds, rows, requests, jobs, queue time and cost, per tenant (docs/tenants.md)."""
    state = app_state()
    return jsonify(tenant_gate.usage(state.settings, state.store, g.identity, request.args, now=time.time()))

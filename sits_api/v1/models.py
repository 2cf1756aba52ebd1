"""Models: register an ONNX file under a name, list the versions, read one."""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from flask import Blueprint, g, jsonify

from broker.models import registry
from broker.tuning import live
from sits_api.intake import registrations, services
from sits_api.schemas import ModelRegistration
from sits_api.state import app_state
from sits_api.tenancy import tenant_gate
from sits_api.v1.caller import check_visible, model_as_seen
from sits_api.v1.parsing import parse_body

blueprint = Blueprint("models", __name__)


@blueprint.post("/v1/models")
def register_model() -> Any:
    """Register an ONNX file (new version when its content changed) under a name that is new or the
    caller's tenant's (another tenant's is a 403). The registration runs off the request threads
    (`sits_api.intake.registrations`): done within `models.registration_wait`, a 201 with the version;
    else a 202 with the registration to poll."""
    state = app_state()
    body = parse_body(ModelRegistration)
    identity = g.identity
    registry.check_may_register(state.store, body.name, identity)  # (another tenant's name: 403 at once)
    registration_id, done = state.registration_pool.start(
        state.store, name=body.name, tenant=tenant_gate.tenant_of(identity), owner=identity.get("name", ""),
        register=lambda: services.register_model(state.settings, state.store, state.dispatcher, body,
                                                 registrant=identity, now=time.time(), tenants=state.tenants),
        finally_=state.registration_slot(identity), now=time.time())
    try:
        record = done.result(timeout=state.settings.models.registration_wait)
    except FutureTimeout:
        return jsonify({"registration": registration_id, "name": body.name, "status": "running",
                        "poll": f"/v1/models/registrations/{registration_id}"}), 202
    return jsonify(record.to_json()), 201


@blueprint.get("/v1/models/registrations/<registration_id>")
def get_registration(registration_id: str) -> Any:
    """How a registration that answered 202 is doing: running, registered (with the version as the caller
    may see it) or failed (with its error); the caller's own, as its jobs are."""
    store = app_state().store
    registration = registrations.get_registration(store, registration_id)
    check_visible(registration.owner, registration.tenant, registrations.registration_not_found(registration_id))
    shown = registration.to_json()
    if registration.ref:
        shown["model"] = model_as_seen(registry.get_model(store, registration.ref))
    return jsonify(shown)


@blueprint.get("/v1/models")
def list_models() -> Any:
    """Every registered model version, with its name's `owner` and file paths to the keys that own it
    (`caller.model_as_seen`); any key may use any model."""
    return jsonify({"models": [model_as_seen(record) for record in registry.list_model_versions(app_state().store)]})


@blueprint.get("/v1/models/<ref>")
def get_model(ref: str) -> Any:
    """One model: `name` (newest version, with the list of versions) or `name@version`, with the
    batching settings workers apply to it (`auto` values resolved from its profile)."""
    state = app_state()
    store = state.store
    record = registry.get_model(store, ref)
    shown = model_as_seen(record)
    if "@" not in ref:
        shown["versions"] = [v.version for v in registry.list_model_versions(store, record.name)]
    override = live.read(store, record.ref)
    return jsonify(shown | {"batching": services.model_batching(state.settings, record, override,
                                                                 now=time.time()).to_dict()})

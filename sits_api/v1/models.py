"""Models: register an ONNX file under a name, list the versions, read one."""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, g, jsonify

from broker.models import registry
from sits_api.intake import services
from sits_api.schemas import ModelRegistration
from sits_api.state import app_state
from sits_api.v1.caller import model_as_seen
from sits_api.v1.parsing import parse_body

blueprint = Blueprint("models", __name__)


@blueprint.post("/v1/models")
def register_model() -> Any:
    """Register an ONNX file (new version when its content changed) under a name that is new or the
    caller's tenant's (another tenant's is a 403)."""
    state = app_state()
    body = parse_body(ModelRegistration)
    with state.registration_slot(g.identity):
        record = services.register_model(state.settings, state.store, state.dispatcher, body,
                                         registrant=g.identity, now=time.time(), tenants=state.tenants)
    return jsonify(record.to_json()), 201


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
    return jsonify(shown | {"batching": services.model_batching(state.settings, record).to_dict()})

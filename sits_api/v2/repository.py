"""Triton's model repository extension over the models of `repository.paths`: index, load, unload.

Thin glue over `sits_api.intake.model_repository`. Admin keys only: loading and unloading change
what every tenant is served. A load that fails is a 400 with the reason, which names the field, as
Triton answers it; the model is then UNAVAILABLE in the index with that reason.
"""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, g, jsonify, request

from broker.errors import BadInput
from broker.models.model_record import ModelRecord
from broker.models.repository import RepositoryServing
from broker.tenants.apikeys import require_role
from sits_api.http.jsonio import parse_object
from sits_api.intake import model_repository
from sits_api.state import app_state

repository = Blueprint("v2_repository", __name__)


def _body() -> dict[str, Any]:
    """The request's JSON object; an empty body is {}, as Triton takes it."""
    raw = request.get_data()
    return parse_object(raw, "a JSON object") if raw.strip() else {}


@repository.post("/v2/repository/index")
def index() -> Any:
    """Every repository model: each loaded version as {name, version, state, reason}, a model without
    one as {name, state, reason}; `{"ready": true}` lists only the READY ones."""
    require_role(g.identity, "admin")
    ready = _body().get("ready", False)
    if not isinstance(ready, bool):
        raise BadInput(f"'ready' must be true or false, got {ready!r}")
    return jsonify(model_repository.repository_index(app_state().store, ready_only=ready))


@repository.post("/v2/repository/models/<name>/load")
def load(name: str) -> Any:
    """Load, or load again, a model of the repository from its folder; 400 with the reason when refused."""
    require_role(g.identity, "admin")
    parameters = _body().get("parameters") or {}
    if parameters:  # Triton's `config` and file overrides: the folder is the one source
        raise BadInput(f"load parameters {sorted(parameters)} are not taken: SITS loads a model from its folder as it "
                       "is; change its config.pbtxt there and load it again")
    state = app_state()
    model_repository.load_model(state.settings, state.store, name, now=time.time())
    return jsonify({})


@repository.post("/v2/repository/models/<name>/unload")
def unload(name: str) -> Any:
    """Unload a model of the repository: its versions are no longer served until it is loaded again."""
    require_role(g.identity, "admin")
    _body()
    model_repository.unload_model(app_state().store, name, now=time.time())
    return jsonify({})


def loaded_config(record: ModelRecord) -> dict[str, Any] | None:
    """The config of a version loaded from a repository, as loaded (None for one registered otherwise)."""
    serving = RepositoryServing.of(record)
    return serving.config if serving is not None else None


def config_tensor(record: ModelRecord, name: str) -> dict[str, Any] | None:
    """Model metadata's entry of input or output `name` of a version loaded from a repository, as its
    config has it: a batch axis (-1) only where `max_batch_size` > 0 (None for one registered otherwise)."""
    serving = RepositoryServing.of(record)
    if serving is None:
        return None
    entry = next((entry for entry in [*serving.config.get("input", []), *serving.config.get("output", [])]
                  if entry.get("name") == name), {})
    dims = [int(dim) for dim in entry.get("dims", [])]
    return {"name": name, "datatype": str(entry.get("data_type", "")).removeprefix("TYPE_"),
            "shape": [-1, *dims] if serving.max_batch_size > 0 else dims}

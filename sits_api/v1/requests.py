"""Online requests: submit one (and wait for its answer), read one."""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, g, jsonify, request

from broker.online import requests
from sits_api.intake import requests as request_intake
from sits_api.schemas import OnlineRequest
from sits_api.state import app_state
from sits_api.tenancy import ab_routes, tenant_gate
from sits_api.v1.caller import check_visible
from sits_api.v1.parsing import parse_body, priority_of, query_flag

blueprint = Blueprint("requests", __name__)


@blueprint.post("/v1/requests")
def submit_request() -> Any:
    """One inference request; 202 with its id, or with `wait` the result (200) when it is done in time."""
    state = app_state()
    body = parse_body(OnlineRequest)
    asked_in_query = query_flag("wait")  # checked before anything is queued, whatever the body says
    wait = body.wait or asked_in_query
    settings, store = state.settings, state.store
    request_id = requests.new_request_id()
    with state.waiting_slot(g.identity, wait), state.inbox.expecting(request_id, wait=wait) as answer:
        model = ab_routes.routed(store, body.model, g.identity, request.headers, "v1")
        tenant = tenant_gate.check_model(state.tenants, store, g.identity, model)
        priority = priority_of(body, tenant)
        tenant_gate.check_entitlements(g.identity, tenant, priority=priority, user_tier=body.user_tier)
        spec = request_intake.submit(settings, store, state.dispatcher, state.policy, model=model,
                                     inputs=body.inputs, priority=priority,
                                     deadline_ms=body.deadline_ms, user_tier=body.user_tier, tokens=body.tokens,
                                     owner=g.identity["name"], now=time.time(), request_id=request_id,
                                     timeout_ms=body.timeout_ms, reply_to=answer.reply_to,
                                     tenant=tenant_gate.tenant_of(g.identity),
                                     max_queued=tenant_gate.caps_of(g.identity, tenant).max_queued,
                                     max_queued_bytes=tenant_gate.caps_of(g.identity, tenant).max_queued_bytes,
                                     max_priority=tenant_gate.priority_cap(tenant))
        done = request_intake.wait_for_result(settings, store, state.policy, answer, spec,
                                              seconds=request_intake.wait_seconds(settings, body.deadline_ms))
    if done:
        return jsonify(request_intake.to_json_result(done)), 200
    return jsonify({"id": spec.request_id, "status": "queued", "model": spec.model_name,
                    "model_version": spec.model_version}), 202


@blueprint.get("/v1/requests/<request_id>")
def get_request(request_id: str) -> Any:
    """A request's status and, once done, its outputs (to the key that submitted it, or an admin). An id
    no request could have answers as an unknown one, without a look into Redis."""
    if not requests.REQUEST_ID_PATTERN.fullmatch(request_id):
        raise requests.request_not_found(request_id)
    record = requests.get_request(app_state().store, request_id)
    check_visible(record.owner, record.tenant, requests.request_not_found(request_id))
    return jsonify(request_intake.to_json_result(record))

"""Tuning a model's batching: start a sweep (`POST /v1/models/<name>/tune`), read its records (`GET`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from flask import Blueprint, g, jsonify

from broker.errors import BadInput, Conflict
from broker.models import registry
from broker.tuning import results, steering
from broker.tuning.front import Space, default_space
from broker.tuning.results import Tuning
from sits_api.state import app_state
from sits_api.tenancy import tenant_gate
from sits_api.tuning import bodies
from sits_api.tuning.sweep import TUNE_TASK, Caller, TuneAsk, cached_tuning, device_kinds, fleet_streams, max_sweeps
from sits_api.v1.parsing import parse_body

blueprint = Blueprint("tuning", __name__)


@blueprint.post("/v1/models/<ref>/tune")
def tune_model(ref: str) -> Any:
    """Send a sweep of the model version to a releaser: 202 with the ask's id and the kinds of device it
    tunes on. Only keys that may add versions under the name may tune it (its tenant's, or an admin):
    an applied pick changes how every tenant's requests of it are batched."""
    state = app_state()
    body = parse_body(bodies.TuneAsk)
    store, settings, identity = state.store, state.settings, g.identity
    record = registry.get_model(store, ref)
    registry.check_may_register(store, record.name, identity)
    tenant_gate.check_model(state.tenants, store, identity, record.ref)
    now = time.time()
    running = results.running(store, record.ref, now=now)
    if running is not None:
        raise results.busy(running)
    live_kinds = device_kinds(settings, store, now=now)
    if body.device_kind and body.device_kind not in live_kinds:  # (it would bar every worker of the model)
        raise Conflict(f"no live {body.device_kind} worker to tune on (live: {', '.join(live_kinds) or 'none'}): "
                       "start one, or ask another device_kind")
    kinds = [body.device_kind] if body.device_kind else live_kinds
    if not kinds:
        raise Conflict("no live worker to tune on: start a worker (sitsctl worker) and ask again")
    space = _asked_space(body, record.profile_points, max(fleet_streams(settings, store, kind=k, now=now)
                                                          for k in kinds))
    settings_count = len(space.settings()) if space else 60
    planned = len(kinds) * (settings_count * len(body.concurrencies) + 2) * (body.settle_seconds + body.cell_seconds)
    if planned > bodies.MAX_SWEEP_SECONDS:
        raise BadInput(f"this sweep would take up to {planned:.0f} s ({settings_count} settings x "
                       f"{len(body.concurrencies)} loads x {body.settle_seconds + body.cell_seconds:g} s on "
                       f"{len(kinds)} kinds of device), past {bodies.MAX_SWEEP_SECONDS:.0f} s: try fewer values, "
                       "fewer concurrencies or shorter cell_seconds")
    ask = TuneAsk(model_ref=record.ref, p99_bound_ms=body.p99_ms, method=body.method, headroom=body.headroom,
                  concurrencies=tuple(int(c) for c in body.concurrencies), cell_seconds=body.cell_seconds,
                  settle_seconds=body.settle_seconds, apply=body.apply, refresh=body.refresh, space=space,
                  device_kinds=tuple(kinds), ask_id=uuid.uuid4().hex)
    caller = Caller(tenant=tenant_gate.tenant_of(identity), owner=str(identity.get("name", "")),
                    role="admin" if identity.get("role") == "admin" else "user")
    measured = [kind for kind in kinds if cached_tuning(settings, store, ask, kind, now=now) is None]
    if measured:  # (an ask the cache answers holds no releaser thread: its model stays free)
        budget = 0.0 if caller.role == "admin" else settings.tuning.tenant_sweep_seconds
        spent = planned * len(measured) / len(kinds)  # (the kinds the cache answers measure nothing)
        results.spend_sweep_seconds(store, caller.tenant, spent, most=budget, now=now)
        try:
            results.claim(store, [Tuning(model_ref=record.ref, device_kind=kind, method=ask.method,
                                         p99_bound_ms=ask.p99_bound_ms, headroom=ask.headroom, started_at=now,
                                         tenant=caller.tenant, ask_id=ask.ask_id) for kind in measured],
                          now=now, most=max_sweeps(settings))
        except Exception:
            if budget:
                results.refund_sweep_seconds(store, caller.tenant, spent, now=now)
            raise
    state.dispatcher.send(TUNE_TASK, ask.to_dict(), caller.to_dict(),
                          queue=settings.beat.queue(settings.redis.key_prefix))
    return jsonify({"model_ref": record.ref, "ask_id": ask.ask_id, "device_kinds": kinds, "status": "queued",
                    "poll": f"/v1/models/{record.ref}/tune", "planned_seconds": round(planned, 1)}), 202


@blueprint.get("/v1/models/<ref>/tune")
def get_tunings(ref: str) -> Any:
    """The model version's last sweep on each kind of device: running (its points so far), done or failed;
    and the batching controller's last changes of it. Any key that may use the model may read them."""
    state = app_state()
    record = registry.get_model(state.store, ref)
    tenant_gate.check_model(state.tenants, state.store, g.identity, record.ref)
    return jsonify({"model_ref": record.ref,
                    "tunings": [_as_seen(t.to_dict(), g.identity) for t in results.read_model(state.store, record.ref)],
                    "controller_changes": steering.recent_changes(state.store, record.ref, limit=50)})


def _asked_space(body: bodies.TuneAsk, profile_points: list[Any], max_streams: int) -> Space | None:
    """The space the body names, its knobs left out taken from the default space; None when it names none
    (each kind then gets its own default)."""
    if body.batch_sizes is None and body.delays_ms is None and body.streams is None:
        return None
    default = default_space(profile_points, p99_bound_ms=body.p99_ms, max_streams=max_streams)
    return Space(tuple(sorted(set(body.batch_sizes))) if body.batch_sizes else default.batch_sizes,
                 tuple(sorted({d / 1000 for d in body.delays_ms})) if body.delays_ms else default.delays,
                 tuple(sorted(set(body.streams))) if body.streams else default.streams)


def _as_seen(tuning: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """A sweep's record as the caller may see it: which tenant asked for it only to that tenant and admins."""
    if identity.get("role") == "admin" or tuning.get("tenant") == tenant_gate.tenant_of(identity):
        return tuning
    return {**tuning, "tenant": ""}

"""Schedules: make, list, read (with recent runs), change, pause, resume, delete and run one now.

A schedule is addressed by its name within the caller's tenant; an admin key names another tenant's
with `?tenant=`. Another tenant's schedule answers 404, as a missing one does.
"""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, g, jsonify, request

from broker.errors import BadInput
from sits_api.schedules import definitions, planner
from sits_api.schedules.bodies import PlanAsk, SchedulePatch, ScheduleSubmission
from sits_api.state import app_state
from sits_api.v1.parsing import parse_body

blueprint = Blueprint("schedules", __name__)


def _tenant() -> str | None:
    """The `?tenant=` an admin key may name (ignored for other keys, which see their own tenant only)."""
    tenant = request.args.get("tenant")
    if tenant is not None and not tenant.strip():
        raise BadInput("tenant must name a tenant, e.g. ?tenant=acme; leave it out for this key's own")
    return tenant


@blueprint.post("/v1/schedules")
def create_schedule() -> Any:
    """Make a schedule of the caller's tenant; answers 201 with it."""
    state = app_state()
    made = definitions.create_schedule(state.settings, state.store, state.tenants, parse_body(ScheduleSubmission),
                                       caller=g.identity, now=time.time())
    return jsonify(made), 201


@blueprint.get("/v1/schedules")
def list_schedules() -> Any:
    """The schedules the caller may read, by tenant and name."""
    listed = definitions.list_visible(app_state().store, caller=g.identity, tenant=_tenant(), now=time.time())
    return jsonify({"schedules": listed})


@blueprint.get("/v1/schedules/plan")
def plan_window() -> Any:
    """The staggering plan of the caller's schedules in a window: each run's release offset, slot cap and
    predicted finish, and the fleet's peak before and after. Changes nothing (POST applies it)."""
    ask = PlanAsk.from_query(request.args)
    return jsonify(_plan(ask, apply=False))


@blueprint.post("/v1/schedules/plan")
def apply_plan() -> Any:
    """The same plan, stored on the schedules the caller may change (their `release_offset` and `slot_cap`)."""
    return jsonify(_plan(parse_body(PlanAsk) if request.get_data() else PlanAsk(), apply=True))


def _plan(ask: PlanAsk, *, apply: bool) -> dict[str, Any]:
    state = app_state()
    return planner.plan(state.settings, state.store, caller=g.identity, tenant=_tenant(), window=ask.window,
                        day=ask.day, timezone=ask.timezone, slots=ask.slots, apply=apply, now=time.time())


@blueprint.get("/v1/schedules/<name>")
def get_schedule(name: str) -> Any:
    """One schedule with its recent runs: slot, job id, status, predicted and actual finish."""
    store = app_state().store
    found = definitions.visible_schedule(store, name, caller=g.identity, tenant=_tenant())
    return jsonify(definitions.describe(store, found, now=time.time()))


@blueprint.patch("/v1/schedules/<name>")
def change_schedule(name: str) -> Any:
    """Change some fields of a schedule."""
    state = app_state()
    changed = definitions.change_schedule(state.settings, state.store, state.tenants, name,
                                          parse_body(SchedulePatch), caller=g.identity, tenant=_tenant(),
                                          now=time.time())
    return jsonify(changed)


@blueprint.delete("/v1/schedules/<name>")
def delete_schedule(name: str) -> Any:
    """Delete a schedule and its runs (the jobs it released stay)."""
    definitions.delete_schedule(app_state().store, name, caller=g.identity, tenant=_tenant())
    return "", 204


@blueprint.post("/v1/schedules/<name>/pause")
def pause_schedule(name: str) -> Any:
    """Release no slot until it resumes."""
    return jsonify(definitions.set_paused(app_state().store, name, True, caller=g.identity, tenant=_tenant(),
                                          now=time.time()))


@blueprint.post("/v1/schedules/<name>/resume")
def resume_schedule(name: str) -> Any:
    """Release its slots again from the next one (the ones passed while paused are not caught up)."""
    return jsonify(definitions.set_paused(app_state().store, name, False, caller=g.identity, tenant=_tenant(),
                                          now=time.time()))


@blueprint.post("/v1/schedules/<name>/run")
def run_schedule_now(name: str) -> Any:
    """Release one run now, outside its slots; answers 201 with the run, released or refused (its reason)."""
    state = app_state()
    run = definitions.run_now(state.settings, state.store, state.dispatcher, state.tenants, name,
                              caller=g.identity, tenant=_tenant(), now=time.time())
    return jsonify(run), 201

"""Offline jobs: submit, list, read, cancel and resume; and the schedulability of a periodic task set."""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, g, jsonify, request

from broker.errors import BadInput, Forbidden
from broker.jobs import lists as job_lists
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.sla.task_sets import TaskSet
from broker.tenants.apikeys import key_tenant, may_read
from sits_api.intake import services
from sits_api.intake import sla_analysis as sla
from sits_api.schemas import MAX_JOBS_LISTED, JobSubmission
from sits_api.state import app_state
from sits_api.v1.caller import caller_job
from sits_api.v1.parsing import parse_body

blueprint = Blueprint("jobs", __name__)


@blueprint.post("/v1/jobs")
def submit_job() -> Any:
    """Submit an offline job; answers 201 with the job."""
    state = app_state()
    body = parse_body(JobSubmission)
    job = services.submit_job(state.settings, state.store, state.dispatcher, body,
                              caller=g.identity, now=time.time(), headers=request.headers, tenants=state.tenants)
    return jsonify(job.to_json()), 201


@blueprint.get("/v1/jobs")
def list_jobs() -> Any:
    """Newest jobs first; `?status=` filters, `?limit=` bounds (default 100).

    A user key lists only its own jobs (naming another `?owner=` is a 403); a tenant-admin or viewer
    key its tenant's; an admin key every job, jobs stored without an owner included, with `?tenant=` those of one
    tenant, and with `?owner=` those of one key name (of every tenant, or of the one named). A key other than an
    admin's lists from its tenant's jobs alone, so `limit` counts its tenant's newest, however many other tenants'
    are newer; naming another tenant lists none, as a tenant without jobs would.
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
    asked = (request.args.get("tenant") or "").strip() or None
    tenant = asked if g.identity.get("role") == "admin" else key_tenant(g.identity)
    if asked not in (None, tenant):  # (another tenant lists as one without jobs)
        return jsonify({"jobs": []})
    listed = job_lists.list_jobs(app_state().store, now=time.time(), limit=limit, status=status_filter, owner=owner,
                                 tenant=tenant)
    # `may_read` decides; the owner and tenant filters above choose which jobs are read
    return jsonify({"jobs": [job.to_json() for job in listed if may_read(g.identity, job.owner, job.tenant)]})


@blueprint.get("/v1/jobs/<job_id>")
def get_job(job_id: str) -> Any:
    """One job with progress, throughput and ETA."""
    return jsonify(caller_job(job_id).to_json())


@blueprint.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> Any:
    """Cancel a job: its waiting chunks leave the queue; a finished job keeps its status."""
    store = app_state().store
    caller_job(job_id, steer=True)
    job_stops.stop_job(store, job_id, status="cancelled", error="cancelled by the user", now=time.time())
    return jsonify(jobs.get_job(store, job_id, now=time.time()).to_json())


@blueprint.post("/v1/jobs/<job_id>/resume")
def resume_job(job_id: str) -> Any:
    """Re-queue only the chunks of a job that are not done."""
    state = app_state()
    caller_job(job_id, steer=True)
    job = services.resume_job(state.settings, state.store, state.dispatcher, job_id, caller=g.identity,
                              now=time.time(), tenants=state.tenants)
    return jsonify(job.to_json()), 202


@blueprint.post("/v1/sla/analysis")
def sla_analysis() -> Any:
    """Schedulability of a periodic task set: utilisation against the Liu-Layland bound, each task's
    response time, and whether all meet their deadlines (docs/sla.md)."""
    state = app_state()
    return jsonify(sla.analyse_task_set(state.settings, state.store, parse_body(TaskSet)))

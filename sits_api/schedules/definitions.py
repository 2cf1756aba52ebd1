"""What the `/v1/schedules` views do, as plain functions: make, change, read and steer schedules.

A schedule belongs to its tenant as a job does (`broker/tenants/apikeys.py`: `may_read`, `owns`): another
tenant's answers 404, as a missing one does. What a schedule would submit is checked when it is made
or changed, as a job submitted now would be, for its next slot: the model and its tenant's rights to
it, the priority within its entitlements, both paths inside the owner's roots, and the schedules it
comes after. Each release checks it all again, as its tenant stands then (`release.py`).
"""

from __future__ import annotations

import math
import secrets
from datetime import UTC, datetime
from typing import Any

from broker.config.settings import Settings
from broker.errors import BadInput, Conflict, Forbidden, JobNotFound, SitsError
from broker.jobs import records as jobs
from broker.models import registry
from broker.schedules import book, runs
from broker.schedules.records import Run, Schedule, member_of, schedule_not_found, slot_job_id
from broker.schedules.slots import Window, check_cron, parse_every, zone
from broker.schedules.templates import check_templates, render
from broker.setting_types import parse_duration
from broker.state.replies import ClaimReply
from broker.state.store import Store
from broker.tenants.apikeys import key_tenant, may_read, owns
from broker.tenants.records import TenantTable
from sits_api.intake import services
from sits_api.intake.task_sender import Dispatcher
from sits_api.schedules.bodies import SchedulePatch, ScheduleSubmission
from sits_api.schedules.release import owner_identity, release_run
from sits_api.schemas import JobSubmission
from sits_api.tenancy import ab_routes, tenant_gate

RUNS_SHOWN = 20
"""The runs `GET /v1/schedules/<name>` lists, newest first."""
MAX_DEADLINE_SECONDS = 366 * 86_400.0
"""The longest deadline after a slot: a job's `deadline_s` takes no more."""


def create_schedule(settings: Settings, store: Store, table: TenantTable, body: ScheduleSubmission, *,
                    caller: dict[str, Any], now: float) -> dict[str, Any]:
    """Store a new schedule of the caller's tenant, owned by the caller's key, once what it would submit
    passes the checks a job's submit makes; the schedule as `describe` shows it."""
    if body.name == "plan":  # (GET /v1/schedules/plan is the window's plan)
        raise BadInput("'plan' names the planning route (GET /v1/schedules/plan); give the schedule another name")
    fields = _cadence_fields(body.model_dump(exclude={"name", "job"}, exclude_none=True))
    schedule = Schedule(name=body.name, tenant=key_tenant(caller), owner=str(caller["name"]),
                        job=_job_fields(body.job), created_at=now, updated_at=now,
                        generation=secrets.token_hex(6), **{"timezone": "UTC", **fields})
    check_schedule(settings, store, table, schedule, caller, now=now)
    most = None if caller.get("role") == "admin" else settings.beat.max_schedules_per_tenant
    book.add_schedule(store, schedule, now=now, most_per_tenant=most,  # (an admin's are not capped, as there)
                      check_among=None if caller.get("role") == "admin"
                      else lambda held: _check_rate_among(settings, schedule, held))
    return describe(store, schedule, now=now)


def change_schedule(settings: Settings, store: Store, table: TenantTable, name: str, body: SchedulePatch, *,
                    caller: dict[str, Any], tenant: str | None, now: float) -> dict[str, Any]:
    """Apply a PATCH; the changed schedule is checked as its owner's as a new one is."""
    found = visible_schedule(store, name, caller=caller, tenant=tenant, steer=True)
    changes = body.changes()
    job = changes.pop("job", None)
    fields = _cadence_fields(changes)
    if "cron" in fields:
        fields["every"] = None
    elif "every" in fields:
        fields["cron"] = None
    if job is not None:
        fields["job"] = _job_fields(job)
    checked: list[Schedule] = []

    def apply(stored: Schedule) -> Schedule:
        changed = stored.changed(updated_at=now, **fields)
        if not checked or checked[-1] != changed:
            check_schedule(settings, store, table, changed, owner_identity(store, changed), now=now, rate=False)
            checked.append(changed)
        return changed

    def check_rate(changed: Schedule, held: list[Schedule]) -> None:  # (each try: the others may have changed)
        if owner_identity(store, changed).get("role") != "admin":
            _check_rate_among(settings, changed, held)

    return describe(store, book.change_schedule(store, found.tenant, name, apply, now=now, check_among=check_rate),
                    now=now)


def set_paused(store: Store, name: str, paused: bool, *, caller: dict[str, Any], tenant: str | None,
               now: float) -> dict[str, Any]:
    """Pause (no slot is released until it resumes) or resume a schedule; a resumed one does not catch up."""
    found = visible_schedule(store, name, caller=caller, tenant=tenant, steer=True)
    changed = book.change_schedule(store, found.tenant, name, lambda stored: stored.changed(paused=paused,
                                                                                            updated_at=now), now=now)
    return describe(store, changed, now=now)


def delete_schedule(store: Store, name: str, *, caller: dict[str, Any], tenant: str | None) -> None:
    """Remove a schedule and its runs; the jobs it released stay."""
    found = visible_schedule(store, name, caller=caller, tenant=tenant, steer=True)
    book.delete_schedule(store, found.tenant, name)


def list_visible(store: Store, *, caller: dict[str, Any], tenant: str | None, now: float) -> list[dict[str, Any]]:
    """The schedules the caller may read: an admin's of every tenant (or of `tenant`), a tenant admin's or
    viewer's of its tenant, a user's own."""
    scope = tenant if caller.get("role") == "admin" else key_tenant(caller)
    return [describe(store, schedule, now=now, runs_shown=0) for schedule in book.list_schedules(store, scope)
            if may_read(caller, schedule.owner, schedule.tenant)]


def visible_schedule(store: Store, name: str, *, caller: dict[str, Any], tenant: str | None,
                     steer: bool = False) -> Schedule:
    """The caller's tenant's schedule `name` (an admin's: `tenant`'s, default its own), if the caller may
    read it (with `steer`: change it); NotFound as for a missing one otherwise, Forbidden for a viewer
    that steers."""
    scope = (tenant or key_tenant(caller)) if caller.get("role") == "admin" else key_tenant(caller)
    schedule = book.get_schedule(store, scope, name)
    if not may_read(caller, schedule.owner, schedule.tenant):
        raise schedule_not_found(name)
    if steer and not owns(caller, schedule.owner, schedule.tenant):
        raise Forbidden(f"key '{caller.get('name')}' has the '{caller.get('role')}' role: it may read this schedule, "
                        "not change it")
    return schedule


def check_schedule(settings: Settings, store: Store, table: TenantTable, schedule: Schedule,
                   identity: dict[str, Any], *, now: float, rate: bool = True) -> None:
    """What `schedule` would submit, checked as a job submitted now by `identity` at its next slot would be
    (model, entitlements, both paths), and its steps before it (this tenant's, no cycle); with `rate`, its
    tenant's releases a minute too (a change checks those inside its transaction instead)."""
    cadence = schedule.cadence()
    check_templates(schedule.job)
    slot = cadence.next_slot(now)
    body = JobSubmission.model_validate(render(schedule.job, cadence.labels(slot)))
    model = registry.get_model(store, ab_routes.routed(store, body.model, identity, {}, "jobs"))
    tenant = tenant_gate.check_model(table, store, identity, model.name)
    priority = body.priority if "priority" in body.model_fields_set or tenant is None or \
        tenant.default_priority is None else tenant.default_priority
    tenant_gate.check_entitlements(identity, tenant, priority=priority)
    for kind, path in (("input", body.input_batch), ("output", body.output_dir)):
        services.resolve_inside(path, services.caller_roots(settings, table, store, identity, kind), kind)  # type: ignore[arg-type]
    _check_steps(store, schedule, identity)
    if rate and identity.get("role") != "admin":
        _check_release_rate(settings, store, schedule)


def releases_per_minute(schedule: Schedule) -> float:
    """The most releases a minute `schedule` asks for: 60 over an `every` period, 1 for a cron (its finest
    step is a minute)."""
    return 60.0 / schedule.every if schedule.every else 1.0


def _check_release_rate(settings: Settings, store: Store, schedule: Schedule) -> None:
    """BadInput when `schedule` would take its tenant's schedules past `beat.max_releases_per_minute` (checked
    again when a new one is stored, among the schedules its transaction reads: `_check_rate_among`)."""
    _check_rate_among(settings, schedule, book.list_schedules(store, schedule.tenant))


def _check_rate_among(settings: Settings, schedule: Schedule, held: list[Schedule]) -> None:
    """`_check_release_rate` among the tenant's schedules `held`."""
    most = settings.beat.max_releases_per_minute
    others = sum(releases_per_minute(other) for other in held if other.name != schedule.name)
    asked = releases_per_minute(schedule)
    if others + asked > most:
        raise BadInput(f"schedule '{schedule.name}' asks for {asked:g} releases a minute; with the tenant's other "
                       f"schedules ({others:g} a minute) that passes beat.max_releases_per_minute ({most}). Give a "
                       "longer period, or delete another schedule")


def _check_steps(store: Store, schedule: Schedule, identity: dict[str, Any]) -> None:
    """BadInput unless every schedule named in `after` is one of this tenant's that `identity` may read, and
    none leads back to this one. One it may not read (another user's) answers as a missing one: a user key
    learns nothing of the schedules of its tenant's other users."""
    if schedule.name in schedule.after:
        raise BadInput(f"schedule '{schedule.name}' cannot come after itself")
    for name in schedule.after:
        before = book.find_schedule(store, member_of(schedule.tenant, name))
        if before is None or not may_read(identity, before.owner, before.tenant):
            raise BadInput(f"after names '{name}', which is no schedule of tenant '{schedule.tenant}' that key "
                           f"'{identity.get('name')}' may read; make it first")
    seen: set[str] = set()
    waiting = list(schedule.after)
    while waiting:
        name = waiting.pop()
        if name == schedule.name:
            raise BadInput(f"after makes a loop: '{schedule.name}' would come after itself through the schedules "
                           "it comes after")
        if name in seen:
            continue
        seen.add(name)
        before = book.find_schedule(store, member_of(schedule.tenant, name))
        waiting.extend(before.after if before is not None else ())


def _cadence_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Schedule fields of a body's cadence part, each checked: BadInput says what to write."""
    fields: dict[str, Any] = {}
    for name, value in body.items():
        if name == "cron":
            fields["cron"] = check_cron(value)
        elif name == "every":
            fields["every"] = parse_every(value)
        elif name == "timezone":
            zone(value or "UTC")
            fields["timezone"] = value or "UTC"
        elif name == "window":
            fields["window"] = None if value is None else Window.parse(value).text()
        elif name == "deadline":
            fields["deadline"] = None if value is None else _seconds(value)
        elif name == "after":
            fields["after"] = tuple(dict.fromkeys(value or ()))
        elif name == "release_offset":
            fields["release_offset"] = _offset(value)
        elif name in ("catch_up", "paused", "slot_cap"):
            fields[name] = value
    return fields


def _offset(value: Any) -> float:
    try:
        seconds = 0.0 if value is None else parse_duration(value)
    except ValueError as err:
        raise BadInput(f"release_offset: {err}") from None
    if not 0 <= seconds <= 86_400.0:
        raise BadInput("release_offset must be from 0 to 1d after each slot, e.g. '15m'")
    return seconds


def _seconds(value: Any) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as err:
        raise BadInput(f"deadline: {err}") from None
    if not 0 < seconds <= MAX_DEADLINE_SECONDS:
        raise BadInput("deadline must be a time after each slot, at most 366d, e.g. '2h'")
    return seconds


def _job_fields(job: JobSubmission) -> dict[str, Any]:
    """The job body a schedule keeps: what the client set, without a deadline of its own (the schedule's
    `deadline` gives each run's, from its slot)."""
    if job.deadline is not None or job.deadline_s is not None:
        raise BadInput("job.deadline and job.deadline_s are each run's: give the schedule's deadline instead "
                       "(e.g. \"deadline\": \"2h\", counted from each slot)")
    return job.model_dump(exclude_unset=True)


def describe(store: Store, schedule: Schedule, *, now: float, runs_shown: int = RUNS_SHOWN) -> dict[str, Any]:
    """A schedule as the API shows it: its fields, its next slot, and its latest runs with each job's end."""
    shown = schedule.to_json()
    for hidden in ("generation", "revision"):
        shown.pop(hidden)
    shown["next_slot"] = None
    if not schedule.paused:
        try:
            shown["next_slot"] = _time(schedule.cadence().next_slot(now))
        except SitsError:
            pass
    if runs_shown:
        shown["runs"] = [describe_run(store, run) for run in runs.recent_runs(store, schedule.member, runs_shown)]
    return shown


def run_now(settings: Settings, store: Store, dispatcher: Dispatcher, table: TenantTable, name: str, *,
            caller: dict[str, Any], tenant: str | None, now: float) -> dict[str, Any]:
    """Release one run of the schedule now, outside its slots (a paused one too), as the beat would:
    claimed at this second, then made by `release.release_run` here; the run, released or refused."""
    for _ in range(3):
        schedule = visible_schedule(store, name, caller=caller, tenant=tenant, steer=True)
        slot = math.floor(now)
        run = Run(slot=slot, status="releasing", job_id=slot_job_id(schedule, slot), due_at=now, claimed_at=now,
                  manual=True, deadline=None if schedule.deadline is None else now + schedule.deadline)
        claim = runs.claim_slot(store, schedule, run, next_due=None, now=now, runs_kept=settings.beat.runs_kept,
                                manual=True)
        if claim.reply == ClaimReply.DUPLICATE:
            raise Conflict(f"schedule '{name}' has a run of this second already; run it again in a second")
        if claim.claimed:
            outcome = release_run(settings, store, dispatcher, table, schedule.member, slot, shared=False)
            settled = runs.get_run(store, schedule.member, slot) or outcome.run or run
            return describe_run(store, settled)
    raise Conflict(f"schedule '{name}' kept changing while it was run; try again")


def describe_run(store: Store, run: Run) -> dict[str, Any]:
    """A run with its slot in UTC and, once its job exists, the job's status and when it finished."""
    try:
        job = jobs.get_job(store, run.job_id, now=run.claimed_at) if run.status == "released" else None
    except JobNotFound:  # (forgotten after jobs.retention)
        job = None
    return {"slot": _time(run.slot), "status": run.status, "job_id": run.job_id if run.status == "released" else None,
            "job_status": None if job is None else job.status, "reason": run.reason or None,
            "catch_up": run.catch_up, "manual": run.manual, "due_at": run.due_at, "released_at": run.released_at,
            "lateness_s": None if run.lateness is None else round(run.lateness, 3),
            "deadline": run.deadline, "predicted_finish": run.predicted_finish,
            "finished_at": None if job is None else job.finished_at}


def _time(instant: float) -> str:
    return datetime.fromtimestamp(instant, UTC).isoformat().replace("+00:00", "Z")

"""`GET /v1/schedules/plan` and `sitsctl schedule plan`: the staggering plan of a window's runs, read from
Redis and worked out by `broker/schedules/planning.py`, and with `apply` stored on the schedules.

What a run costs comes from the schedule's latest released run (its job's rows, chunks and batch size)
and its model's measured speed, calibrated as deadline admission calibrates it; a schedule that has not
run yet is listed as left out, with why. Each planned run is then checked as its release will be:
admission's prediction at its planned release, the runs planned before it still running
(`finish_prediction.admit`), and the window's set of runs by the response-time analysis of periodic
tasks on the fleet (`broker/sla/analysis.py`, a sufficient test that ignores the offsets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from broker.config.settings import Settings
from broker.errors import BadInput, JobNotFound, NotFound, SitsError
from broker.jobs import records as jobs
from broker.jobs.finish_prediction import EXACT_CHUNKS, Fleet, Work, admit
from broker.models import registry
from broker.schedules import book, runs
from broker.schedules.planning import Load, PlanRun, Release, WorkBudget, simulate, stagger, unstaggered
from broker.schedules.records import Schedule
from broker.schedules.slots import Window, zone
from broker.sla.analysis import analyse
from broker.sla.figures import calibrations, live_fleet, model_speed
from broker.sla.task_sets import PeriodicTask
from broker.state.store import Store
from broker.tenants.apikeys import key_tenant, may_read, owns

MOST_RUNS = 500
"""The most runs one plan looks at (a seconds-level schedule in a long window has thousands: plan those
by hand)."""
RUN_HISTORY = 10
"""The latest runs of a schedule looked at for one whose job tells what a run costs."""


@dataclass(frozen=True)
class Span:
    """The stretch of time planned: a window on one day, or the next 24 hours."""

    start: float
    end: float
    window: str | None


def plan(settings: Settings, store: Store, *, caller: dict[str, Any], tenant: str | None, window: str | None,
         day: str | None, timezone: str, slots: int | None, apply: bool, now: float) -> dict[str, Any]:
    """The plan of the caller's schedules (an admin's: every tenant's, or `tenant`'s) whose slots fall in
    `window` on `day` (default: the window's next opening; no window: the next 24 hours); with `apply`,
    each planned schedule the caller may change gets its offset and cap."""
    span = _span(window, day, timezone, now=now)
    scope = tenant if caller.get("role") == "admin" else key_tenant(caller)
    schedules = [found for found in book.list_schedules(store, scope)
                 if may_read(caller, found.owner, found.tenant) and not found.paused]
    fleet_slots = slots if slots is not None else live_fleet(settings, store, now=now).slots
    if fleet_slots < 1:
        raise BadInput("no live worker to plan for: start one, or say how many stream slots to plan for "
                       "(slots=N)")
    planned, left_out = _runs(settings, store, schedules, span)
    current = {run.member: Release(_by_member(schedules)[run.member].release_offset,
                                   _by_member(schedules)[run.member].slot_cap) for run in planned}
    budget = WorkBudget()  # (one budget for the whole answer: PlanTooLarge, a 400, past it)
    before = simulate(planned, unstaggered(planned), fleet_slots=fleet_slots, budget=budget)
    releases = stagger(planned, fleet_slots=fleet_slots, margin=settings.sla.admission_margin, budget=budget)
    answer: dict[str, Any] = {
        "window": span.window, "from": _time(span.start), "until": _time(span.end), "slots": fleet_slots,
        "left_out": left_out,
    }
    if releases is None:
        late = before.late(planned)
        answer |= {"feasible": False, "before": _load(before, planned), "runs": [],
                   "reason": f"{len(late)} of {len(planned)} runs cannot finish before their deadlines even "
                             "on every slot of the fleet: move a deadline or add workers"}
        return answer
    after = simulate(planned, releases, fleet_slots=fleet_slots, budget=budget)
    checks = _admission(planned, releases, after, fleet_slots=fleet_slots, margin=settings.sla.admission_margin,
                        floor=settings.sla.admission_margin_floor, budget=budget)
    answer |= {
        "feasible": not after.late(planned),
        "before": _load(before, planned),
        "after": _load(after, planned),
        "peak_drop": round(before.peak_slots / after.peak_slots, 2) if after.peak_slots else None,
        "runs": [_run_row(run, releases[run.member], current.get(run.member), before, after, checks)
                 for run in sorted(planned, key=lambda run: (run.slot, run.member))],
        "response_time_analysis": _response_times(planned, releases, schedules, fleet_slots),
        "applied": [],
    }
    if apply:
        answer["applied"] = _apply(store, schedules, releases, caller=caller, now=now)
    return answer


PLAN_DAYS_AHEAD = 3_660
"""How far ahead a plan's `day` may lie: ten years."""


def _span(window: str | None, day: str | None, timezone: str, *, now: float) -> Span:
    """The planned stretch of time: `window` on `day` in `timezone`, or the next 24 hours."""
    tz = zone(timezone)
    if window is None:
        if day is not None:
            raise BadInput("day needs a window: give window=HH:MM-HH:MM too, or leave day out for the next 24 h")
        return Span(now, now + 86_400.0, None)
    parsed = Window.parse(window)
    today = current = datetime.fromtimestamp(now, tz).date()
    if day is not None:
        try:
            today = datetime.strptime(day, "%Y-%m-%d").date()
        except ValueError:
            raise BadInput(f"day {day!r} must be a date as YYYY-MM-DD, e.g. 2026-12-08") from None
        first, last = current - timedelta(days=1), current + timedelta(days=PLAN_DAYS_AHEAD)
        if not first <= today <= last:  # (a window past 9999-12-31's end would run into year 10000: a 500)
            raise BadInput(f"day {day} is outside what a plan covers: from yesterday to {PLAN_DAYS_AHEAD} days "
                           f"ahead ({first} to {last})")
    opens = datetime.combine(today, datetime.min.time(), tz) + timedelta(minutes=parsed.start)
    length = (parsed.end - parsed.start) % 1440 or 1440
    if day is None and (opens + timedelta(minutes=length)).timestamp() <= now:
        opens += timedelta(days=1)  # (today's has closed: the next one)
    start = opens.timestamp()
    return Span(start, start + length * 60.0, parsed.text())


def _runs(settings: Settings, store: Store, schedules: list[Schedule], span: Span) -> tuple[list[PlanRun],
                                                                                           list[dict[str, str]]]:
    """The runs of `schedules` whose slots fall in `span`, and the schedules left out, each with why."""
    planned: list[PlanRun] = []
    left_out: list[dict[str, str]] = []
    factors = calibrations(store)
    for schedule in schedules:
        slots = _slots_in(schedule, span)
        if not slots:
            continue
        try:
            cost = _cost(store, schedule, factors)
        except _LeftOut as why:
            left_out.append({"schedule": schedule.name, "tenant": schedule.tenant, "reason": str(why)})
            continue
        if len(planned) + len(slots) > MOST_RUNS:
            raise BadInput(f"the span holds more than {MOST_RUNS} runs; plan a shorter window")
        for slot in slots:
            deadline = slot + schedule.deadline if schedule.deadline is not None else span.end
            planned.append(replace(cost, slot=float(slot), deadline_at=deadline))
    return planned, left_out


def _slots_in(schedule: Schedule, span: Span) -> list[int]:
    cadence = replace(schedule.cadence(), release_offset=0.0)
    found: list[int] = []
    try:
        slot = cadence.next_slot(span.start - 1)
        while slot < span.end and len(found) <= MOST_RUNS:
            found.append(slot)
            slot = cadence.next_slot(slot)
    except SitsError:  # (no slot to come within a search's reach)
        pass
    return found


class _LeftOut(Exception):
    """Why a schedule's runs are not planned."""


def _cost(store: Store, schedule: Schedule, factors: dict[str, float]) -> PlanRun:
    """What one run of `schedule` costs, from its latest released run's job and its model's speed."""
    for run in runs.recent_runs(store, schedule.member, RUN_HISTORY):
        if run.status != "released":
            continue
        try:
            job = jobs.get_job(store, run.job_id, now=run.claimed_at)
            record = registry.get_model(store, job.model_ref)
        except (JobNotFound, NotFound):
            continue
        speed = model_speed(record, int(job.batch_size or 1))
        version = job.model_ref.partition("@")[2]
        return PlanRun(member=schedule.member, slot=0.0, deadline_at=0.0, rows=int(job.rows_total),
                       chunks=max(1, int(job.chunks_total)),
                       seconds_per_row=speed.seconds_per_row * factors.get(version, 1.0))
    raise _LeftOut("no released run to learn its rows from: release one (run-now) and plan again")


def _admission(planned: list[PlanRun], releases: dict[str, Release], after: Load, *, fleet_slots: int,
               margin: float, floor: float, budget: WorkBudget) -> dict[tuple[str, float], tuple[float, bool]]:
    """Each run as admission will see it at its planned release: (predicted finish, admitted), with the
    runs released before it still holding what the plan leaves them of their work then."""
    out: dict[tuple[str, float], tuple[float, bool]] = {}
    for run in planned:
        at = run.slot + releases[run.member].offset
        active = [_left_at(other, releases[other.member], after, at) for other in planned
                  if other is not run and other.slot + releases[other.member].offset <= at]
        new = _work(run, releases[run.member], run.slot_seconds)
        running = [work for work in active if work is not None]
        budget.spend(20 * sum(min(work.chunks, EXACT_CHUNKS) for work in [*running, new]))  # (admit places each twice)
        verdict = admit(new, running, Fleet(slots=fleet_slots), now=at,
                        margin=margin, margin_floor=floor)
        out[(run.member, run.slot)] = (verdict.predicted_finish, verdict.feasible)
    return out


def _left_at(run: PlanRun, release: Release, load: Load, at: float) -> Work | None:
    key = (run.member, run.slot)
    start, finish = load.starts.get(key, at), load.finishes.get(key, math.inf)
    if finish <= at:
        return None
    done = 0.0 if at <= start or math.isinf(finish) else (at - start) / (finish - start)
    return _work(run, release, run.slot_seconds * (1 - done))


def _work(run: PlanRun, release: Release, seconds: float) -> Work:
    return Work(f"{run.member}@{run.slot:.0f}", score=run.deadline_at, seconds=seconds, deadline_at=run.deadline_at,
                chunks=run.chunks, max_slots=release.slots)


def _response_times(planned: list[PlanRun], releases: dict[str, Release], schedules: list[Schedule],
                    fleet_slots: int) -> dict[str, Any]:
    """The response-time analysis of the window's runs as periodic tasks on the fleet's slots: each run as
    its cap's lanes of equal work, its period its schedule's (a day for a daily run), deadline-monotonic.
    It assumes every run released at once, so it proves a plan without relying on its offsets."""
    tasks: list[PeriodicTask] = []
    by_member = _by_member(schedules)
    for run in planned:
        lanes = max(1, min(releases[run.member].slots or run.chunks, run.chunks))
        period = _period(by_member[run.member], run.slot)
        for lane in range(lanes):
            ms = run.slot_seconds / lanes * 1000
            tasks.append(PeriodicTask(name=f"{by_member[run.member].name}@{run.slot:.0f}#{lane}", wcet_ms=ms,
                                      period_ms=period * 1000, deadline_ms=(run.deadline_at - run.slot) * 1000,
                                      section_ms=run.slot_seconds / run.chunks * 1000))
    if not tasks:
        return {"feasible": True, "verdict": "no runs"}
    answer = analyse(tasks, policy="deadline-monotonic", workers=fleet_slots)
    return {"feasible": answer["feasible"], "verdict": answer["verdict"], "analysis": answer["analysis"],
            "utilisation": answer["utilisation"]}


def _period(schedule: Schedule, slot: float) -> float:
    """Seconds from `slot` to the schedule's next slot (a day at most: what a window's plan repeats over)."""
    try:
        return min(86_400.0, float(replace(schedule.cadence(), release_offset=0.0).next_slot(slot) - slot))
    except SitsError:
        return 86_400.0


def _apply(store: Store, schedules: list[Schedule], releases: dict[str, Release], *, caller: dict[str, Any],
           now: float) -> list[str]:
    """Store each planned offset and cap on its schedule, where the caller may change it; the names done."""
    done = []
    for schedule in schedules:
        release = releases.get(schedule.member)
        if release is None or not owns(caller, schedule.owner, schedule.tenant):
            continue
        book.change_schedule(store, schedule.tenant, schedule.name,
                             lambda stored, release=release: stored.changed(  # type: ignore[misc]
                                 release_offset=release.offset, slot_cap=release.slots, updated_at=now), now=now)
        done.append(schedule.name)
    return done


def _by_member(schedules: list[Schedule]) -> dict[str, Schedule]:
    return {schedule.member: schedule for schedule in schedules}


def _load(load: Load, planned: list[PlanRun]) -> dict[str, Any]:
    return {"peak_slots": load.peak_slots, "peak_rows_per_second": load.peak_rows_per_second,
            "late_runs": len(load.late(planned))}


def _run_row(run: PlanRun, release: Release, current: Release | None, before: Load, after: Load,
             checks: dict[tuple[str, float], tuple[float, bool]]) -> dict[str, Any]:
    key = (run.member, run.slot)
    predicted, admitted = checks[key]
    tenant, _, name = run.member.partition("|")
    return {
        "schedule": name, "tenant": tenant, "slot": _time(run.slot), "deadline": _time(run.deadline_at),
        "rows": run.rows, "slot_seconds": round(run.slot_seconds, 3),
        "offset_s": release.offset, "max_slots": release.slots,
        "stored": {"offset_s": current.offset, "max_slots": current.slots} if current else None,
        "finish_before": _time(before.finishes.get(key)), "finish": _time(after.finishes.get(key)),
        "predicted_finish": _time(predicted), "admitted": admitted,
        "on_time": after.finishes.get(key, math.inf) <= run.deadline_at,
    }


def _time(unix: float | None) -> str | None:
    if unix is None or not math.isfinite(unix):
        return None
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")

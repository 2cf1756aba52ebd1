"""A release: the job of one claimed run, made as its schedule's owner would submit it at that slot.

The beat claimed the slot (`broker/schedules/passes.py`) and sent the run here; this makes its job under
the slot's own id (`records.slot_job_id`) through the very submit of `POST /v1/jobs`
(`services.submit_job`): the same model, entitlement, path and cap checks, as the owner's key and tenant
stand now, and deadline admission with the run's deadline. One releaser at a time holds a run
(`keys.release_lease`); a message delivered twice, or sent again by the beat, finds the run settled or
its job made, and makes nothing. A release that is refused is recorded on the run with its reason and
counted (`sits_schedule_releases_total{outcome="refused"}`); one that meets Redis out of reach (or its
input changing while it is read) is left releasing, and the beat sends it again after `beat.release_timeout`,
at most `RELEASE_TRIES` times: then it is refused with the last reason. A releaser keeps its hold on the run
while it works (a large input's read and checksum may take longer than the hold), so that the beat's resend
finds it busy rather than starting a second read beside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from broker.config.settings import Settings
from broker.errors import BadInput, Forbidden, QueueFull, RetryableError, SitsError
from broker.jobs import records as jobs
from broker.schedules.book import find_schedule
from broker.schedules.records import Run, Schedule, split_member
from broker.schedules.release_places import (
    give_back_release_place,
    release_id,
    renew_release_place,
    take_release_place,
)
from broker.schedules.runs import get_run, run_id, settle_run, touch_releasing
from broker.schedules.stats import MISSED, refusal_counts, release_counts
from broker.schedules.templates import render
from broker.state.holds import Hold, take_hold
from broker.state.replies import SettleReply
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import list_api_keys
from broker.tenants.records import TenantTable
from sits_api.intake import services
from sits_api.intake.task_sender import Dispatcher
from sits_api.schemas import JobSubmission

log = logging.getLogger(__name__)

SUBMITTING_ROLES = ("user", "tenant-admin", "admin")
"""The roles whose keys submit jobs, least first: a schedule acts as the least of its owner's keys."""


@dataclass(frozen=True)
class Outcome:
    """What one release did: `released`, `refused`, `missed`, or nothing (`settled`: the run had moved on;
    `busy`: another releaser holds it; `deferred`: its tenant's release places were taken, the beat sends it
    again after a quarter of its wait, 1 to 10 s)."""

    outcome: str
    run: Run | None = None

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome, **({"run": self.run.to_json()} if self.run else {})}


RELEASE_TRIES = 5
"""Most releases of one run that end retryable (Redis out of reach, its input changing as it is read); the
next is refused. Without it a run whose input a tenant keeps changing is sent again every
`beat.release_timeout` for ever, each time reading the whole file on a releaser every tenant shares."""


def release_run(settings: Settings, store: Store, dispatcher: Dispatcher, table: TenantTable, member: str,
                slot: int, *, clock: Callable[[], float] = time.time, shared: bool = True) -> Outcome:
    """Make the job of run (`member`, `slot`) if it is still releasing, and settle the run. On a releaser
    (`shared`), within its tenant's release places; a run-now, made on its caller's API thread, takes none."""
    hold = _take_run(settings, store, member, slot)
    if hold is None:
        return Outcome("busy")
    tenant, release = split_member(member)[0], release_id(run_id(member, slot), hold.token)
    if shared and _waits_for_place(settings, store, member, slot, release, now=clock()):
        _defer(settings, store, member, slot, hold, now=clock())
        return Outcome("deferred")
    stop_holding = _keep_holding(settings, hold, member, slot, tenant=tenant, release=release)
    try:
        return _release(settings, store, dispatcher, table, member, slot, clock=clock)
    except RetryableError as err:
        if _tried(settings, store, member, slot) >= RELEASE_TRIES:
            run = get_run(store, member, slot)
            if run is not None and run.status == "releasing" and jobs.job_owner(store, run.job_id).status is None:
                # (its job made by an earlier try, it is only settling that failed: sent again, never refused)
                refusal = SitsError(f"refused after {RELEASE_TRIES} tries that failed for a while; the last: "
                                    f"{err.message}")
                refusal.code = err.code  # (counted under its cause)
                return _refuse(store, member, run, refusal)
        stop_holding()
        with suppress(RetryableError):  # (Redis away: the hold lapses by itself)
            hold.drop()  # (the beat's next send finds it free)
        raise
    finally:
        stop_holding()  # (a run settled keeps its hold until it lapses: a message delivered twice finds it busy)
        with suppress(RetryableError):  # (Redis away: the place lapses by itself)
            give_back_release_place(store, tenant, release)


DEFER_SECONDS = (1.0, 10.0)
"""How soon the beat sends again a release its tenant's places turned away (`beat.releases_per_tenant`): a
quarter of how long the run has waited since it was due, within these bounds, so that many runs waiting
behind one long release cost a message each every few seconds, not every second."""


def _waits_for_place(settings: Settings, store: Store, member: str, slot: int, release: str, *, now: float) -> bool:
    """Whether the run must wait for one of its tenant's release places: True when they are all taken and the
    run is still to be made (one settled, or whose window closed, is settled at once: that reads no input)."""
    tenant = split_member(member)[0]
    if take_release_place(store, tenant, release, most=settings.beat.releases_per_tenant,
                          hold_seconds=settings.beat.release_timeout, now=now):
        return False
    run, schedule = get_run(store, member, slot), find_schedule(store, member)
    if run is None or run.status != "releasing" or schedule is None:
        return False
    closes = schedule.cadence().window_end(slot)
    return closes is None or now < closes or run.manual


def _defer(settings: Settings, store: Store, member: str, slot: int, hold: Hold, *, now: float) -> None:
    """Leave run (`member`, `slot`) releasing, for the beat to send again soon (as a lost release is,
    `BeatPass.send_lost_releases`: `DEFER_SECONDS`), and let the releaser that takes it then hold it."""
    run = get_run(store, member, slot)
    waited = now - (run.due_at if run is not None else now)
    wait = min(DEFER_SECONDS[1], max(DEFER_SECONDS[0], waited / 4))
    touch_releasing(store, member, slot, now=now - settings.beat.release_timeout + wait)
    hold.drop()


def _release(settings: Settings, store: Store, dispatcher: Dispatcher, table: TenantTable, member: str,
             slot: int, *, clock: Callable[[], float]) -> Outcome:
    run = get_run(store, member, slot)
    schedule = find_schedule(store, member)
    if run is None or run.status != "releasing" or schedule is None:
        return Outcome("settled", run)
    now = clock()
    closes = schedule.cadence().window_end(slot)
    if closes is not None and now >= closes and not run.manual:
        missed = replace(run, status="missed", reason="its window closed before a releaser took it",
                         reason_code="missed")
        settle_run(store, member, missed, expect=("releasing",), add={MISSED: 1.0})
        return Outcome("missed", missed)
    if jobs.job_owner(store, run.job_id).status is None:
        try:
            _submit(settings, store, dispatcher, table, schedule, run, now=now)
        except QueueFull as err:  # the tenant's max_inflight, or its schedules: a cap, not an outage
            return _refuse(store, member, run, err)
        except RetryableError:
            raise  # left releasing: the beat sends it again after beat.release_timeout
        except SitsError as err:
            if jobs.job_owner(store, run.job_id).status is None:  # (not a twin's job made meanwhile)
                return _refuse(store, member, run, err)
    return _released(settings, store, member, run, now=clock())


def owner_identity(store: Store, schedule: Schedule) -> dict[str, Any]:
    """The identity a schedule's releases act as: its owner's key (of its tenant), as it stands now; of
    several keys of that name, the least of them. Forbidden when none is left that may submit."""
    keys = [key for key in list_api_keys(store, schedule.tenant) if key["name"] == schedule.owner]
    usable = sorted((key for key in keys if key["role"] in SUBMITTING_ROLES),
                    key=lambda key: SUBMITTING_ROLES.index(key["role"]))
    if not usable:
        raise Forbidden(f"schedule '{schedule.name}' acts as key '{schedule.owner}' of tenant '{schedule.tenant}', "
                        "which has no key of that name that may submit jobs any more; make the schedule again "
                        "with a key that may")
    key = usable[0]
    return {"name": key["name"], "role": key["role"], "tenant": key["tenant"],
            **({"group": key["group"]} if key.get("group") else {})}


def job_body(schedule: Schedule, slot: int) -> JobSubmission:
    """The job a schedule submits at `slot`: its templates filled in, its deadline counted from the slot."""
    body = render(schedule.job, schedule.cadence().labels(slot))
    if schedule.deadline is not None:
        body["deadline"] = datetime.fromtimestamp(slot + schedule.deadline, UTC).isoformat()
    if schedule.slot_cap is not None:  # (its plan's cap; a tighter one of the job's own stays)
        body["max_slots"] = min(schedule.slot_cap, body.get("max_slots") or schedule.slot_cap)
    try:
        return JobSubmission.model_validate(body)
    except ValidationError as err:
        raise BadInput(f"the job of slot {slot} is not a valid job: {err.errors()[0]['msg']}") from err


def _submit(settings: Settings, store: Store, dispatcher: Dispatcher, table: TenantTable, schedule: Schedule,
            run: Run, *, now: float) -> None:
    services.submit_job(settings, store, dispatcher, job_body(schedule, run.slot),
                        caller=owner_identity(store, schedule), now=now, tenants=table, job_id=run.job_id)


def _take_run(settings: Settings, store: Store, member: str, slot: int) -> Hold | None:
    """Hold run (`member`, `slot`) for one releaser, for `beat.release_timeout`; None while another holds it."""
    return take_hold(store, store.keys.release_lease(run_id(member, slot)), int(settings.beat.release_timeout * 1000))


def _keep_holding(settings: Settings, hold: Hold, member: str, slot: int, *, tenant: str,
                  release: str) -> Callable[[], None]:
    """Renew `hold` on run (`member`, `slot`), and its tenant's release place, every third of
    `beat.release_timeout` until the function returned is called, or until the hold is found lapsed
    (another releaser may hold the run by then: its hold is left alone)."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(settings.beat.release_timeout / 3):
            try:
                renew_release_place(hold.store, tenant, release, hold_seconds=settings.beat.release_timeout,
                                    now=time.time())
                if not hold.renew():
                    log.warning("the hold on run %s|%d lapsed while its release went on", member, slot)
                    return
            except Exception:  # (Redis away a moment: the hold lapses, and the beat's resend may take the run)
                log.warning("could not renew the hold on run %s|%d", member, slot, exc_info=True)

    threading.Thread(target=renew, name="sits-release-hold", daemon=True).start()
    return stop.set


def _tried(settings: Settings, store: Store, member: str, slot: int) -> int:
    """Count one more retryable try of run (`member`, `slot`); the tries so far."""
    key = store.keys.release_tries(run_id(member, slot))
    with translate_redis_errors(), store.client.pipeline(transaction=False) as pipe:
        pipe.incr(key)
        pipe.expire(key, int(settings.beat.release_timeout * (RELEASE_TRIES + 2)) + 3600)
        tries, _ = pipe.execute()
    return int(tries)


def _released(settings: Settings, store: Store, member: str, run: Run, *, now: float) -> Outcome:
    job = jobs.get_job(store, run.job_id, now=now)
    released = replace(run, status="released", released_at=now, reason="", reason_code="",
                       predicted_finish=job.predicted_finish, deadline=job.deadline)
    add, set_ = release_counts(released.lateness or 0.0, late_after=settings.beat.late_after, catch_up=run.catch_up)
    if settle_run(store, member, released, expect=("releasing",), add=add, set_=set_) != SettleReply.SETTLED:
        return Outcome("settled", get_run(store, member, run.slot))
    log.info("released %s at slot %d: job %s, %.3fs after it was due", member, run.slot, run.job_id,
             released.lateness or 0.0)
    return Outcome("released", released)


def _refuse(store: Store, member: str, run: Run, err: SitsError) -> Outcome:
    refused = replace(run, status="refused", reason=err.message, reason_code=err.code)
    if settle_run(store, member, refused, expect=("releasing",), add=refusal_counts(err.code)) != SettleReply.SETTLED:
        return Outcome("settled", get_run(store, member, run.slot))
    log.warning("release of %s at slot %d refused: %s", member, run.slot, err.message)
    return Outcome("refused", refused)

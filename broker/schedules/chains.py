"""Chains: a schedule released `after` others waits for the same slot's run of each to have succeeded.

A step whose job failed (or whose release was refused or missed) holds the steps after it, and their
runs say so; once it is resumed and succeeds, the next look releases them. The beat looks at each held
run every pass (`broker/schedules/passes.py`); a run held past its window's end is missed.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.jobs.records import job_owner
from broker.schedules.book import find_schedule
from broker.schedules.records import Schedule, member_of
from broker.schedules.runs import get_run
from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class ChainState:
    """Whether a run may be released now: `ready`, or held, with `reason` and its one-word `code`
    (`waiting` while the steps before it run; `step_failed` while one of them failed or was refused)."""

    ready: bool
    reason: str = ""
    code: str = ""


READY = ChainState(True)


def chain_state(store: Store, schedule: Schedule, slot: int) -> ChainState:
    """Whether `schedule`'s run of `slot` may be released: each schedule it comes `after` has a run of the
    same slot whose job succeeded."""
    for name in schedule.after:
        state = _step_state(store, schedule.tenant, name, slot)
        if not state.ready:
            return state
    return READY


def _step_state(store: Store, tenant: str, name: str, slot: int) -> ChainState:
    before = find_schedule(store, member_of(tenant, name))
    if before is None:
        return ChainState(False, f"step '{name}' no longer exists: make it again, or remove it from after",
                          "step_failed")
    run = get_run(store, before.member, slot)
    if run is None:
        with translate_redis_errors():
            cursor = store.client.hget(store.keys.schedule_cursors, before.member)
        if cursor is None or int(cursor) < slot:
            return ChainState(False, f"waiting for step '{name}' to release this slot", "waiting")
        return ChainState(False, f"step '{name}' has no run of this slot (paused, or its slots differ)", "step_failed")
    if run.status in ("releasing", "held"):
        return ChainState(False, f"waiting for step '{name}', {run.status}", "waiting")
    if run.status != "released":
        return ChainState(False, f"step '{name}' was {run.status} at this slot: {run.reason}", "step_failed")
    status = job_owner(store, run.job_id).status
    if status == "succeeded":
        return READY
    if status in ("queued", "running"):
        return ChainState(False, f"waiting for step '{name}': its job {run.job_id} is {status}", "waiting")
    if status is None:
        return ChainState(False, f"step '{name}''s job {run.job_id} is gone (past jobs.retention)", "step_failed")
    return ChainState(False, f"step '{name}''s job {run.job_id} {status}; resume it (sitsctl job resume "
                             f"{run.job_id}) and this step is released once it succeeds", "step_failed")

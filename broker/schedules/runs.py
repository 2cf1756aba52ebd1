"""A schedule's runs: claim a slot (once), settle a run, and read them back.

The claim and every later move of a run are each one script (`claim_slot.lua`, `settle_run.lua`), so
that two beats, two releasers or a message delivered twice find the slot decided, or the run moved on,
and do nothing. Whatever a run's releaser does in between is made once by its job id: the same for a
slot on every try (`records.slot_job_id`), and a job id is created once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from broker.schedules.records import Run, RunStatus, Schedule, split_member
from broker.state.replies import ClaimReply, SettleReply
from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class Claim:
    """What `claim_slot` answered: `reply`, and for a DUPLICATE the run that slot already has."""

    reply: ClaimReply
    run: Run | None = None

    @property
    def claimed(self) -> bool:
        return self.reply == ClaimReply.CLAIMED


def run_id(member: str, slot: int) -> str:
    """'member|slot': how the releasing and held indexes and the releasers name one run."""
    return f"{member}|{slot}"


def split_run_id(text: str) -> tuple[str, int]:
    """(member, slot) of a `run_id`."""
    member, _, slot = text.rpartition("|")
    return member, int(slot)


def claim_slot(store: Store, schedule: Schedule, run: Run | None, *, next_due: float | None, now: float,
               runs_kept: int, manual: bool = False) -> Claim:
    """Decide one slot of `schedule` (as read, at its revision): write `run` and move the cursor to its slot,
    unless that slot is decided already; also (or, without a run, only) set when the beat looks next."""
    keys = store.keys
    member = schedule.member
    options = {"revision": schedule.revision, "slot": run.slot if run else None, "status": run.status if run else None,
               "run": run.dumps() if run else None, "next_due": next_due, "runs_kept": runs_kept, "now": now,
               "manual": manual}
    with translate_redis_errors():
        reply = store.scripts.claim_slot(
            keys=[keys.schedules, keys.schedule_cursors, keys.schedules_due, keys.schedule_runs(member),
                  keys.schedule_run_slots(member), keys.schedule_runs_releasing, keys.schedule_runs_held,
                  keys.schedule_stats],
            args=[member, json.dumps(options)])
    code = ClaimReply(int(reply[0]))
    existing = reply[1] if len(reply) > 1 and reply[1] else None
    return Claim(code, Run.loads(existing) if existing else None)


def settle_run(store: Store, member: str, run: Run, *, expect: tuple[RunStatus, ...], at: float = 0.0,
               add: Mapping[str, float] | None = None, set_: Mapping[str, float] | None = None) -> SettleReply:
    """Replace a run in one of the statuses `expect` by `run` (`at`: its score in the releasing or held index),
    adding `add` to the schedule's running totals and setting `set_` among them."""
    keys = store.keys
    options = {"slot": run.slot, "expect": list(expect), "status": run.status, "run": run.dumps(), "at": at,
               "add": dict(add or {}), "set": dict(set_ or {})}
    with translate_redis_errors():
        reply = store.scripts.settle_run(
            keys=[keys.schedule_runs(member), keys.schedule_runs_releasing, keys.schedule_runs_held,
                  keys.schedule_stats],
            args=[member, json.dumps(options)])
    return SettleReply(int(reply[0]))


def get_run(store: Store, member: str, slot: int) -> Run | None:
    """The run of `member` at `slot`, None when it has none kept."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.schedule_runs(member), str(slot))
    return None if raw is None else Run.loads(raw)


def recent_runs(store: Store, member: str, limit: int = 20) -> list[Run]:
    """The schedule's `limit` latest runs, newest first."""
    keys = store.keys
    with translate_redis_errors():
        slots = store.client.zrevrange(keys.schedule_run_slots(member), 0, max(0, limit - 1))
        stored = store.client.hmget(keys.schedule_runs(member), slots) if slots else []
    return [Run.loads(raw) for raw in stored if raw]


def runs_due(store: Store, index: str, *, now: float, limit: int = 100) -> list[tuple[str, int]]:
    """(member, slot) of the runs in `index` (the releasing or held one) whose score is `now` or before."""
    with translate_redis_errors():
        found = store.client.zrangebyscore(index, "-inf", now, start=0, num=limit)
    return [split_run_id(text) for text in found]


def touch_releasing(store: Store, member: str, slot: int, *, now: float) -> None:
    """Mark a releasing run's release as sent again at `now` (only while it is still releasing)."""
    with translate_redis_errors():
        store.client.zadd(store.keys.schedule_runs_releasing, {run_id(member, slot): now}, xx=True)


def held_runs(store: Store) -> dict[tuple[str, str], int]:
    """(tenant, name) -> how many runs of that schedule are held now."""
    with translate_redis_errors():
        found = store.client.zrange(store.keys.schedule_runs_held, 0, -1)
    counts: dict[tuple[str, str], int] = {}
    for text in found:
        member, _ = split_run_id(text)
        counts[split_member(member)] = counts.get(split_member(member), 0) + 1
    return counts

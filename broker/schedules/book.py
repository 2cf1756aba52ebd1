"""The stored schedules: add, change, pause, resume, delete, read and list them.

A schedule's definition (`keys.schedules`), its cursor (`keys.schedule_cursors`, the last slot decided)
and its next look (`keys.schedules_due`) change together, in one transaction over the definitions
(WATCH), so that a beat pass never sees one without the others. A change moves the cursor up to now:
slots before a change, a resume or a creation are never released late for it, only those after.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import redis

from broker.errors import Conflict, QueueFull
from broker.schedules.records import Schedule, member_of, schedule_not_found
from broker.state.store import Store, translate_redis_errors


def next_look(schedule: Schedule, *, now: float) -> float:
    """When the beat first looks at `schedule` after a change at `now`: its next slot's due time."""
    cadence = schedule.cadence()
    return cadence.due_at(cadence.next_slot(now))


def add_schedule(store: Store, schedule: Schedule, *, now: float, most_per_tenant: int | None,
                 check_among: Callable[[list[Schedule]], None] | None = None) -> Schedule:
    """Store a new schedule; Conflict when its tenant has one of that name, QueueFull (429) when it holds
    `most_per_tenant` already (None: no cap). `check_among` is called with the tenant's schedules as the
    transaction reads them, and raises to refuse: a cap over all of them (their releases a minute) checked
    before the write, so that creates at once cannot each pass it against the others' absence."""
    keys = store.keys
    due = next_look(schedule, now=now)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.schedules)
                if pipe.hexists(keys.schedules, schedule.member):
                    raise Conflict(f"a schedule named '{schedule.name}' exists already; choose another name, or "
                                   "change it with PATCH /v1/schedules/<name>")
                if most_per_tenant is not None or check_among is not None:
                    tenants = [Schedule.loads(raw)
                               for _, raw in pipe.hscan_iter(keys.schedules, match=f"{schedule.tenant}|*", count=500)]
                    if check_among is not None:
                        check_among(tenants)
                    held = len(tenants)
                    if most_per_tenant is not None and held >= most_per_tenant:
                        raise QueueFull(f"tenant '{schedule.tenant}' holds {held} schedules, the most a tenant may "
                                        "(beat.max_schedules_per_tenant); delete one first", retry_after=60)
                pipe.multi()
                pipe.hset(keys.schedules, schedule.member, schedule.dumps())
                pipe.hset(keys.schedule_cursors, schedule.member, math.floor(now))
                if not schedule.paused:
                    pipe.zadd(keys.schedules_due, {schedule.member: due})
                pipe.execute()
                return schedule
            except redis.WatchError:
                continue


def get_schedule(store: Store, tenant: str, name: str) -> Schedule:
    """Tenant `tenant`'s schedule `name`; NotFound when it has none of that name."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.schedules, member_of(tenant, name))
    if raw is None:
        raise schedule_not_found(name)
    return Schedule.loads(raw)


def find_schedule(store: Store, member: str) -> Schedule | None:
    """The schedule `member` names, None when it was deleted."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.schedules, member)
    return None if raw is None else Schedule.loads(raw)


def list_schedules(store: Store, tenant: str | None) -> list[Schedule]:
    """Tenant `tenant`'s schedules (None: every tenant's), by tenant and name."""
    keys = store.keys
    with translate_redis_errors():
        if tenant is None:
            stored = list(store.client.hvals(keys.schedules))
        else:
            stored = [raw for _, raw in store.client.hscan_iter(keys.schedules, match=f"{tenant}|*", count=500)]
    return sorted((Schedule.loads(raw) for raw in stored), key=lambda schedule: (schedule.tenant, schedule.name))


def change_schedule(store: Store, tenant: str, name: str, change: Callable[[Schedule], Schedule], *,
                    now: float, check_among: Callable[[Schedule, list[Schedule]], None] | None = None) -> Schedule:
    """Apply `change` to the stored schedule (a copy with a higher revision: `Schedule.changed`) and store
    it, with its next look and its cursor moved up to now; NotFound when there is none. The transaction
    watches every schedule's definition and cursor (the beat moves cursors all the time), so it is tried
    at most `CHANGE_TRIES` times, `change` (the caller's checks) run each time: then Conflict (409), to retry,
    rather than a request that loops while others write. `check_among` is called with the changed schedule
    and its tenant's schedules as the transaction reads them, as `add_schedule`'s is: so that changes sent
    at once cannot each pass a cap over all of them against the others' old values."""
    keys = store.keys
    member = member_of(tenant, name)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        for _ in range(CHANGE_TRIES):
            try:
                pipe.watch(keys.schedules, keys.schedule_cursors)
                raw = pipe.hget(keys.schedules, member)
                if raw is None:
                    raise schedule_not_found(name)
                changed = change(Schedule.loads(raw))
                if check_among is not None:
                    check_among(changed, [Schedule.loads(held) for _, held in
                                          pipe.hscan_iter(keys.schedules, match=f"{tenant}|*", count=500)])
                cursor = pipe.hget(keys.schedule_cursors, member)
                due = None if changed.paused else next_look(changed, now=now)
                pipe.multi()
                pipe.hset(keys.schedules, member, changed.dumps())
                pipe.hset(keys.schedule_cursors, member, max(int(cursor or 0), math.floor(now)))
                if due is None:
                    pipe.zrem(keys.schedules_due, member)
                else:
                    pipe.zadd(keys.schedules_due, {member: due})
                pipe.execute()
                return changed
            except redis.WatchError:
                continue
    raise Conflict(f"schedule '{name}' could not be changed: other schedules changed {CHANGE_TRIES} times while "
                   "it was; send the change again")


CHANGE_TRIES = 20
"""Most tries of one change's transaction (each one's WATCH broken by another write) before a 409."""


def delete_schedule(store: Store, tenant: str, name: str) -> None:
    """Remove a schedule with its runs (the jobs it released stay); NotFound when there is none."""
    keys = store.keys
    member = member_of(tenant, name)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.schedules)
                if not pipe.hexists(keys.schedules, member):
                    raise schedule_not_found(name)
                slots = pipe.zrange(keys.schedule_run_slots(member), 0, -1)
                pipe.multi()
                pipe.hdel(keys.schedules, member)
                pipe.hdel(keys.schedule_cursors, member)
                pipe.zrem(keys.schedules_due, member)
                pipe.delete(keys.schedule_runs(member), keys.schedule_run_slots(member))
                if slots:
                    pipe.zrem(keys.schedule_runs_releasing, *(f"{member}|{slot}" for slot in slots))
                    pipe.zrem(keys.schedule_runs_held, *(f"{member}|{slot}" for slot in slots))
                pipe.execute()
                break
            except redis.WatchError:
                continue
        stats = [field for field, _ in store.client.hscan_iter(keys.schedule_stats, match=f"{member}|*", count=500)]
        if stats:
            store.client.hdel(keys.schedule_stats, *stats)

"""The schedules' running totals for /metrics: releases, refusals (by reason), misses, lateness.

Kept in one HASH (`keys.schedule_stats`, 'tenant|name|<what>'), added to by the scripts that decide and
settle runs (`claim_slot.lua`, `settle_run.lua`), read whole at each scrape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.schedules.records import split_member
from broker.state.store import Store, translate_redis_errors

RELEASED, REFUSED, MISSED, LATE, CAUGHT_UP = "released", "refused", "missed", "late", "caught_up"
LATENESS_SUM, LATENESS_COUNT, LAST_LATENESS = "lateness_sum", "lateness_count", "last_lateness"
REFUSED_BECAUSE = "refused_"
"""A refusal is also counted under 'refused_<error code>' (deadline_infeasible, queue_full, forbidden, ...)."""


@dataclass
class ScheduleTotals:
    """One schedule's running totals."""

    totals: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, float] = field(default_factory=dict)
    """Error code -> refusals for it."""

    def get(self, what: str) -> float:
        return self.totals.get(what, 0.0)


def release_counts(lateness: float, *, late_after: float, catch_up: bool) -> tuple[dict[str, float], dict[str, float]]:
    """What a release adds to its schedule's totals, and what it sets, given its lateness in seconds."""
    add = {RELEASED: 1.0, LATENESS_SUM: lateness, LATENESS_COUNT: 1.0}
    if lateness > late_after:
        add[LATE] = 1.0
    if catch_up:
        add[CAUGHT_UP] = 1.0
    return add, {LAST_LATENESS: lateness}


def refusal_counts(code: str) -> dict[str, float]:
    """What a refused release adds to its schedule's totals."""
    return {REFUSED: 1.0, REFUSED_BECAUSE + code: 1.0}


def read_schedule_stats(store: Store) -> dict[tuple[str, str], ScheduleTotals]:
    """(tenant, name) -> the schedule's running totals."""
    with translate_redis_errors():
        stored = store.client.hgetall(store.keys.schedule_stats)
    found: dict[tuple[str, str], ScheduleTotals] = {}
    for key, value in stored.items():
        member, _, what = key.rpartition("|")
        totals = found.setdefault(split_member(member), ScheduleTotals())
        if what.startswith(REFUSED_BECAUSE):
            totals.refusals[what.removeprefix(REFUSED_BECAUSE)] = float(value)
        else:
            totals.totals[what] = float(value)
    return found


def beat_running(store: Store) -> bool:
    """Whether a beat holds its turn now (it renews it at every pass)."""
    with translate_redis_errors():
        return bool(store.client.exists(store.keys.beat_turn))

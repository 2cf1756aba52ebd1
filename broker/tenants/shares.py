"""Tenants' shares of the fleet: which tenant's work goes first, which one waits, and who pays for a run.

Pure functions, the clock passed in; not yet called by the worker's leasing or by the API.

- A tenant's *usage* is its device-seconds, decayed with a half-life (as Kueue's admission fair
  sharing decays usage), so that what it ran a minute ago counts less than what it runs now, and a
  tenant that was idle comes back with little usage and goes first.
- The *fleet's capacity* over the same decay is the stream slots alive times the mean life of the
  decay (`half_life / ln 2`): what the slots would add up to had they run without a pause.
- `fair_order` ranks the tenants with work by usage over guaranteed share (lowest first: a tenant
  below its share goes before one above it), and holds back a tenant whose usage is past its
  limit (`guaranteed_share * limit` of the capacity): it borrows idle share up to there, no further.
- `attribute` bills a run's measured device time to the tenants in it by their rows (tokens for
  token models); the parts add up to the whole exactly, so the sum over tenants is the time measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from broker.errors import ConfigError


@dataclass(frozen=True)
class TenantShare:
    """A tenant's guaranteed share of the fleet's device time (0..1) and its limit: the most it may use
    when others are idle, as a multiple of its share (1.0: never more than its share)."""

    guaranteed_share: float
    limit: float = 1.0


@dataclass(frozen=True)
class Usage:
    """Decayed device-seconds `value` as of the unix time `at`."""

    value: float = 0.0
    at: float = 0.0


def validate_shares(shares: Mapping[str, TenantShare]) -> None:
    """ConfigError naming the tenant at fault: a share outside [0, 1], a limit below 1, or guarantees that
    sum past the whole fleet (the tenant named is the one whose share takes the sum past 1)."""
    total = 0.0
    for name, share in shares.items():
        if not 0.0 <= share.guaranteed_share <= 1.0:
            raise ConfigError(f"tenant '{name}': guaranteed_share must be a fraction in [0, 1], got "
                              f"{share.guaranteed_share}")
        if share.limit < 1.0:
            raise ConfigError(f"tenant '{name}': limit is a multiple of its share (1.0 or more), got {share.limit}")
        total += share.guaranteed_share
        if total > 1.0 + 1e-9:
            raise ConfigError(f"tenant '{name}': guaranteed shares sum to {total:.3f} with its "
                              f"{share.guaranteed_share}, past the whole fleet (1.0); lower its share or another "
                              "tenant's")


def decayed(usage: Usage, *, now: float, half_life: float) -> float:
    """`usage` as of `now`: halved for every `half_life` seconds since it was noted (never grown by a
    clock that went back)."""
    if half_life <= 0:
        return 0.0
    return usage.value * 2.0 ** (-max(0.0, now - usage.at) / half_life)


def add_usage(usage: Usage, device_seconds: float, *, now: float, half_life: float) -> Usage:
    """`usage` decayed to `now`, plus a run's `device_seconds`."""
    return Usage(decayed(usage, now=now, half_life=half_life) + device_seconds, now)


def capacity(stream_slots: int, *, half_life: float) -> float:
    """Decayed device-seconds the fleet's `stream_slots` would add up to if every slot ran without a pause."""
    return max(0, stream_slots) * half_life / math.log(2)


def fair_order(shares: Mapping[str, TenantShare], usage: Mapping[str, Usage], waiting: list[str], *,
               stream_slots: int, half_life: float, now: float) -> tuple[list[str], set[str]]:
    """The tenants in `waiting` (those with work queued) in the order their work should go, and those held
    back (past their limit: their work waits although a slot is free).

    Ranked by decayed usage over guaranteed share, lowest first; a tenant with no share (or none
    configured) ranks after every tenant that has one, by its usage, and is never held (it lives on
    what others leave idle). Ties keep the order of `waiting` (the queue's).
    """
    fleet = capacity(stream_slots, half_life=half_life)
    used = {name: decayed(usage.get(name, Usage()), now=now, half_life=half_life) for name in waiting}

    def rank(name: str) -> tuple[int, float]:
        share = shares.get(name)
        if share is None or share.guaranteed_share <= 0:
            return 1, used[name]
        return 0, used[name] / share.guaranteed_share

    order = sorted(dict.fromkeys(waiting), key=rank)
    held = {name for name in order
            if name in shares and shares[name].guaranteed_share > 0 and fleet > 0
            and used[name] > shares[name].guaranteed_share * shares[name].limit * fleet}
    return order, held


def attribute(device_seconds: float, work_by_tenant: Mapping[str, float]) -> dict[str, float]:
    """`device_seconds` of one run split over its tenants by their share of its work (rows, or tokens);
    the parts sum to `device_seconds` exactly (the last tenant takes what rounding left). A run with no
    work counted is billed evenly."""
    names = [name for name in work_by_tenant if work_by_tenant[name] > 0] or list(work_by_tenant)
    if not names:
        return {}
    total = sum(work_by_tenant[name] for name in names)
    parts: dict[str, float] = {}
    for name in names[:-1]:
        weight = work_by_tenant[name] / total if total > 0 else 1 / len(names)
        parts[name] = device_seconds * weight
    parts[names[-1]] = device_seconds - sum(parts.values())
    return parts

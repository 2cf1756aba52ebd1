"""Tenants' shares (`broker/tenants/shares.py`): the order work goes in, who is held back, who pays.

The simulation drives the pure functions with a clock of its own: one slot runs batches of fixed
length, each time for the tenant `fair_order` puts first; the measured shares must come out as the
guarantees when both flood, as the limit when one borrows alone, and the tenant that returns must
get the very next batch.
"""

from __future__ import annotations

import pytest

from broker.errors import ConfigError
from broker.tenants.shares import (
    TenantShare,
    Usage,
    add_usage,
    attribute,
    capacity,
    decayed,
    fair_order,
    validate_shares,
)

SHARES = {"s1": TenantShare(0.7, 1.2), "s2": TenantShare(0.3, 3.0)}
HALF_LIFE = 10.0


Runs = list[tuple[float, str]]


def simulate(waiting_at, *, seconds: float, batch: float = 0.01, start: float = 0.0,
             usage: dict[str, Usage] | None = None) -> tuple[dict[str, float], dict[str, Usage], Runs]:
    """Run one slot for `seconds` from `start`; `waiting_at(now)` names the tenants with work then.
    Returns device-seconds per tenant, the usage at the end and the (time, tenant) of every batch."""
    usage = dict(usage or {})
    spent: dict[str, float] = {}
    runs = []
    now = start
    while now < start + seconds:
        order, held = fair_order(SHARES, usage, waiting_at(now), stream_slots=1, half_life=HALF_LIFE, now=now)
        runnable = [name for name in order if name not in held]
        if runnable:
            tenant = runnable[0]
            usage[tenant] = add_usage(usage.get(tenant, Usage()), batch, now=now + batch, half_life=HALF_LIFE)
            spent[tenant] = spent.get(tenant, 0.0) + batch
            runs.append((now, tenant))
        now += batch
    return spent, usage, runs


def test_two_flooding_tenants_get_their_guaranteed_shares():
    spent, _, _ = simulate(lambda now: ["s2", "s1"], seconds=30.0)
    total = sum(spent.values())
    assert spent["s1"] / total == pytest.approx(0.7, abs=0.02)
    assert spent["s2"] / total == pytest.approx(0.3, abs=0.02)


def test_a_tenant_alone_borrows_up_to_its_limit_and_the_owner_gets_the_next_batch_back():
    _, usage, _ = simulate(lambda now: ["s2", "s1"], seconds=30.0)
    spent, usage, _ = simulate(lambda now: ["s2"], seconds=30.0, start=30.0, usage=usage)
    assert spent["s2"] / 30.0 > 0.9  # it takes the whole slot while its usage climbs to the limit
    spent, usage, _ = simulate(lambda now: ["s2"], seconds=30.0, start=60.0, usage=usage)
    # then holds at its limit, 3.0 x 30 % = 90 % of the slot: the slot idles the rest
    assert spent["s2"] / 30.0 == pytest.approx(0.9, abs=0.02)
    _, _, runs = simulate(lambda now: ["s2", "s1"], seconds=1.0, start=90.0, usage=usage)
    assert runs[0] == (90.0, "s1")  # back below its share: its work is first at the next batch
    assert [tenant for _, tenant in runs[:20]] == ["s1"] * 20


def test_a_tenant_without_a_share_lives_on_what_others_leave():
    order, held = fair_order(SHARES, {"s1": Usage(1.0, 0.0)}, ["guest", "s1"], stream_slots=4,
                             half_life=HALF_LIFE, now=0.0)
    assert order == ["s1", "guest"] and held == set()


def test_a_tenant_past_its_limit_is_held():
    fleet = capacity(2, half_life=HALF_LIFE)
    usage = {"s1": Usage(0.7 * 1.2 * fleet + 1.0, 5.0), "s2": Usage(0.0, 5.0)}
    order, held = fair_order(SHARES, usage, ["s1", "s2"], stream_slots=2, half_life=HALF_LIFE, now=5.0)
    assert order == ["s2", "s1"] and held == {"s1"}
    # a minute later its usage has decayed: it runs again
    _, held = fair_order(SHARES, usage, ["s1"], stream_slots=2, half_life=HALF_LIFE, now=65.0)
    assert held == set()


def test_usage_halves_every_half_life_and_a_clock_going_back_grows_nothing():
    assert decayed(Usage(8.0, 100.0), now=130.0, half_life=10.0) == pytest.approx(1.0)
    assert decayed(Usage(8.0, 100.0), now=90.0, half_life=10.0) == 8.0


@pytest.mark.parametrize("shares, message", [
    ({"a": TenantShare(0.7), "b": TenantShare(0.4)}, "tenant 'b': guaranteed shares sum to 1.100"),
    ({"a": TenantShare(1.5)}, "tenant 'a': guaranteed_share must be a fraction"),
    ({"a": TenantShare(0.5, 0.5)}, "tenant 'a': limit is a multiple of its share"),
])
def test_shares_that_do_not_fit_the_fleet_are_refused_naming_the_tenant(shares, message):
    with pytest.raises(ConfigError, match=message):
        validate_shares(shares)
    validate_shares({"a": TenantShare(0.7, 1.2), "b": TenantShare(0.3, 3.0)})


def test_a_merged_batch_is_billed_by_rows_and_the_parts_sum_to_the_run():
    parts = attribute(0.004, {"a": 3, "b": 1})
    assert parts["a"] == pytest.approx(0.003) and parts["b"] == pytest.approx(0.001)
    runs = [(0.0123 * (i % 7 + 1), {"a": i % 5 + 1, "b": (i * 3) % 4, "c": 1}) for i in range(1000)]
    billed = [attribute(seconds, work) for seconds, work in runs]
    assert sum(sum(part.values()) for part in billed) == pytest.approx(sum(seconds for seconds, _ in runs), rel=1e-12)
    assert attribute(1.0, {"a": 0, "b": 0}) == {"a": 0.5, "b": 0.5}

"""A merged batch's rows by the tenants' shares (`broker/tenants/batch_shares.py`), pure, the clock passed in.

The simulation runs one slot with its own clock: closed-loop clients of two tenants (each sends its next
one-row request a round trip after its answer), batches formed by `fair_order` and `split_batch` as the
lease forms them, each run billed by rows (`attribute`) into the tenants' decayed usage. The device time
must split by the shares while both flood, as it does not when every waiting request joins the batch,
and a tenant alone must get full batches.
"""

from __future__ import annotations

import pytest

from broker.tenants.batch_shares import BatchShares, BatchSplit, present_tenants, ranked_shares, split_batch
from broker.tenants.shares import TenantShare, Usage, add_usage, attribute, fair_order

NOW = 1_000.0
PRESENT_FOR = 0.05
S1_FIRST = BatchShares((("s1", 0.7), ("s2", 0.3)), PRESENT_FOR)


def test_the_tenant_below_its_share_fills_first_and_the_other_gets_its_share_s_part_of_the_rows() -> None:
    split = split_batch(S1_FIRST, waiting={"s1": 8, "s2": 8}, served_at={}, head_tenant="s1", anchor_rows=8, now=NOW)
    assert split == BatchSplit("s1", {"s2": 3})  # floor(8 * 0.3 / 0.7): 3 of 11 rows, under its 30 %
    assert split.most_rows("s1") is None and split.most_rows("s2") == 3
    assert split.most_rows("no-share") == 0  # a tenant without a share lives on idle share
    seven = split_batch(S1_FIRST, waiting={"s1": 7, "s2": 8}, served_at={}, head_tenant="s1", anchor_rows=7, now=NOW)
    assert seven is not None and seven.most_rows("s2") == 3  # exactly 30 % (no float error rounds it down)


def test_the_tenant_over_its_share_ranking_first_caps_the_other_by_its_larger_share() -> None:
    s2_first = BatchShares((("s2", 0.3), ("s1", 0.7)), PRESENT_FOR)
    split = split_batch(s2_first, waiting={"s1": 8, "s2": 3}, served_at={}, head_tenant="s2", anchor_rows=3, now=NOW)
    assert split is not None and split.most_rows("s1") == 7 and split.most_rows("s2") is None


def test_a_tenant_alone_is_not_capped() -> None:
    assert split_batch(S1_FIRST, waiting={"s2": 8}, served_at={}, head_tenant="s2", anchor_rows=8, now=NOW) is None
    gone = {"s1": NOW - 0.06}  # its last request answered longer than a presence ago: it is gone
    assert split_batch(S1_FIRST, waiting={"s2": 8}, served_at=gone, head_tenant="s2", anchor_rows=8, now=NOW) is None
    # with a tenant without a share beside it: no split either (its requests go after, as the order says)
    assert split_batch(S1_FIRST, waiting={"s2": 8, "free": 4}, served_at={}, head_tenant="s2", anchor_rows=8,
                       now=NOW) is None


def test_a_present_tenant_with_nothing_waiting_holds_the_others_until_its_presence_ends() -> None:
    served = {"s1": NOW - 0.01}  # answered 10 ms ago: its client is sending the next one
    held = split_batch(S1_FIRST, waiting={"s2": 5}, served_at=served, head_tenant="s2", anchor_rows=5, now=NOW)
    assert held == BatchSplit("s1", hold=True) and held.most_rows("s2") == 0
    later = NOW + 0.05
    assert split_batch(S1_FIRST, waiting={"s2": 5}, served_at=served, head_tenant="s2", anchor_rows=5,
                       now=later) is None


def test_no_caps_when_the_anchor_does_not_head_the_batch() -> None:
    # (its work waits in another shape bucket, or an order that left it out a moment put another first)
    assert split_batch(S1_FIRST, waiting={"s1": 2, "s2": 5}, served_at={}, head_tenant="s2", anchor_rows=5,
                       now=NOW) is None


def test_the_anchor_is_the_first_ranked_present_tenant() -> None:
    three = BatchShares((("a", 0.5), ("b", 0.3), ("c", 0.2)), PRESENT_FOR)
    assert present_tenants(three, waiting={"c": 1}, served_at={"b": NOW - 0.001}, now=NOW) == [("b", 0.3),
                                                                                              ("c", 0.2)]
    assert present_tenants(three, waiting={}, served_at={"a": NOW - 1.0}, now=NOW) == []
    split = split_batch(three, waiting={"b": 4, "c": 9}, served_at={}, head_tenant="b", anchor_rows=6, now=NOW)
    assert split is not None and split.quotas == {"a": 10, "c": 4}


def test_ranked_shares_keep_the_order_and_leave_out_held_tenants_and_tenants_without_a_share() -> None:
    assert ranked_shares(["s2", "free", "s1", "capped"], {"capped"},
                         {"s1": 0.5, "s2": 0.2, "capped": 0.3, "free": 0.0}) == (("s2", 0.2), ("s1", 0.5))
    assert S1_FIRST.to_lua() == {"ranked": [{"tenant": "s1", "share": 0.7}, {"tenant": "s2", "share": 0.3}],
                                 "present_for": PRESENT_FOR, "in_flight_for": 0.0}


# --- one slot, closed-loop clients ------------------------------------------------------------------------

SHARES = {"s1": TenantShare(0.7, 1.2), "s2": TenantShare(0.3, 3.0)}
HALF_LIFE = 10.0


def simulate(clients: dict[str, int], *, seconds: float = 60.0, split: bool = True, row_seconds: float = 0.002,
             run_seconds: float = 0.001, round_trip: float = 0.003,
             max_rows: int = 64) -> tuple[dict[str, float], dict[str, int], list[int]]:
    """One slot serving closed-loop clients (`clients`: tenant -> how many) for `seconds`: a client's next
    one-row request arrives `round_trip` after its answer; a batch takes what `split_batch` allows (with
    `split`; else every waiting request), runs `run_seconds` plus `row_seconds` a row, and is billed by
    rows. Returns device-seconds and requests served per tenant, and the rows of every batch."""
    usage: dict[str, Usage] = {}
    served_at: dict[str, float] = {}
    back_at = {tenant: [0.0] * count for tenant, count in clients.items()}  # when each client's request arrives
    spent = dict.fromkeys(clients, 0.0)
    answered = dict.fromkeys(clients, 0)
    batches = []
    now = 0.0
    while now < seconds:
        waiting = {tenant: sum(1 for at in times if at <= now) for tenant, times in back_at.items()}
        order, held = fair_order(SHARES, usage, list(clients), stream_slots=1, half_life=HALF_LIFE, now=now)
        heads = [tenant for tenant in order if waiting[tenant] and tenant not in held]
        if not heads:
            now = min(at for times in back_at.values() for at in times if at > now)
            continue
        shares = BatchShares(ranked_shares(order, held, {name: share.guaranteed_share
                                                         for name, share in SHARES.items()}), PRESENT_FOR)
        decision = split_batch(shares, waiting=waiting, served_at=served_at, head_tenant=heads[0],
                               anchor_rows=min(waiting[heads[0]], max_rows), now=now) if split else None
        if decision is not None and decision.hold:  # the slot waits for the next arrival, or the presence's end
            arrivals = [at for times in back_at.values() for at in times if at > now]
            now = min([*arrivals, max(served_at.values()) + PRESENT_FOR])
            continue
        taken: dict[str, int] = {}
        for tenant in heads:
            most = decision.most_rows(tenant) if decision is not None else None
            room = max_rows - sum(taken.values())
            taken[tenant] = min(waiting[tenant], room, most if most is not None else room)
        rows = sum(taken.values())
        ends = now + run_seconds + row_seconds * rows
        for tenant, seconds_billed in attribute(ends - now, taken).items():
            usage[tenant] = add_usage(usage.get(tenant, Usage()), seconds_billed, now=ends, half_life=HALF_LIFE)
            spent[tenant] += seconds_billed
        for tenant, count in taken.items():
            ready = sorted(at for at in back_at[tenant] if at <= now)[:count]
            for at in ready:
                back_at[tenant].remove(at)
                back_at[tenant].append(ends + round_trip)
            answered[tenant] += count
            if count:
                served_at[tenant] = ends
        batches.append(rows)
        now = ends
    return spent, answered, batches


def test_two_closed_loop_floods_split_the_device_by_the_shares_and_every_waiting_request_does_not() -> None:
    spent, answered, _ = simulate({"s1": 8, "s2": 8})
    assert spent["s1"] / sum(spent.values()) == pytest.approx(0.7, abs=0.02)
    assert answered["s1"] / sum(answered.values()) == pytest.approx(0.7, abs=0.03)  # rows: what a bill splits by

    merged, _, _ = simulate({"s1": 8, "s2": 8}, split=False)  # every waiting request in the batch
    assert merged["s1"] / sum(merged.values()) == pytest.approx(0.5, abs=0.05)


def test_the_tenant_below_its_share_keeps_most_of_its_throughput_alone() -> None:
    _, shared, _ = simulate({"s1": 8, "s2": 8})
    _, alone, _ = simulate({"s1": 8})
    assert shared["s1"] >= 0.7 * alone["s1"], (shared, alone)


def test_a_tenant_alone_gets_full_batches_and_a_fixed_run_cost_is_still_split_by_rows() -> None:
    _, answered, batches = simulate({"s2": 8}, seconds=5.0)
    assert batches[1:] and min(batches[1:]) == 8 and answered["s2"] >= 8 * (len(batches) - 1)
    spent, _, _ = simulate({"s1": 8, "s2": 8}, row_seconds=0.0, run_seconds=0.02)  # a GPU's flat curve
    assert spent["s1"] / sum(spent.values()) == pytest.approx(0.7, abs=0.03)

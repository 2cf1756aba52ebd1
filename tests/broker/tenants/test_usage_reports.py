"""What a usage report costs Redis: the fields it reads of each day's bill, and one report of whole bills
at a time per tenant (real Redis; the work counted by `INFO commandstats`)."""

from __future__ import annotations

import pytest

from broker.errors import QueueFull
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.usage import BillEntry
from tests.broker.broker_helpers import NOW

DAYS = 3
PRICES = {"gpu": 3600.0, "cpu": 360.0}  # 1 per gpu-second, 0.1 per cpu-second


def bill_days(store: Store) -> int:
    """Three days of acme's bills, each naming 40 models and 10 keys besides bob's; the first day's number."""
    for day in range(DAYS):
        entries = [BillEntry("acme", f"key{n % 10}", f"m{n}@v1", "gpu", seconds=1.0, rows=1) for n in range(40)]
        entries.append(BillEntry("acme", "bob", "m0@v1", "cpu", seconds=2.0, rows=5, requests=1, queue_seconds=0.5))
        tenant_usage.note_usage(store, entries, now=NOW + day * 86_400, half_life=30)
    return tenant_usage.day_number(NOW)


def calls(store: Store) -> dict[str, int]:
    """How many HGETALL and HMGET calls the server has answered so far."""
    stats = store.client.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("hgetall", "hmget")}


def report(store: Store, by: tenant_usage.Breakdown, first: int, **kwargs: str) -> tuple[list, dict[str, int]]:
    """The report of acme's days from `first` `by`, and the HGETALL and HMGET calls it made."""
    before = calls(store)
    rows = tenant_usage.usage_report(store, ["acme"], first_day=first, last_day=first + DAYS - 1, by=by,
                                     prices=PRICES, **kwargs)
    return rows, {name: count - before[name] for name, count in calls(store).items()}


def test_a_report_by_tenant_or_day_reads_only_the_totals_of_each_bill(store: Store) -> None:
    first = bill_days(store)

    by_tenant, tenant_calls = report(store, "tenant", first)
    by_day, day_calls = report(store, "day", first)

    assert tenant_calls == day_calls == {"hgetall": 0, "hmget": DAYS}  # not 200-odd fields a day
    assert by_tenant == [{"tenant": "acme", "device_seconds": 126.0, "rows": 135, "requests": 3, "failed": 0,
                          "jobs": 0, "queue_seconds": 1.5, "cost": 120.6}]  # 40 gpu-s and 2 cpu-s a day
    assert [(row["day"], row["device_seconds"], row["cost"]) for row in by_day] == [
        (tenant_usage.day_text(first + day), 42.0, 40.2) for day in range(DAYS)]


def test_a_report_of_one_key_reads_only_that_key_s_fields_and_shows_its_rows_alone(store: Store) -> None:
    first = bill_days(store)

    own, own_calls = report(store, "key", first, key="bob")
    every, every_calls = report(store, "key", first)

    assert own_calls == {"hgetall": 0, "hmget": DAYS}
    assert own == [{"tenant": "acme", "key": "bob", "device_seconds": 6.0, "rows": 15, "requests": 3, "failed": 0,
                    "jobs": 0, "queue_seconds": 1.5, "cost": pytest.approx(
                        DAYS * 40.2 * 2 / 42)}]  # its share of each day's cost, by device-seconds, as before
    assert own == [row for row in every if row["key"] == "bob"] and len(every) == 11
    assert every_calls == {"hgetall": DAYS, "hmget": 0}
    assert report(store, "key", first, key="nobody")[0] == []


def test_a_tenant_runs_one_report_of_whole_bills_at_a_time_and_rests_after_it(store: Store) -> None:
    assert [tenant_usage.reads_whole_bills(by) for by in tenant_usage.BREAKDOWNS] == [False, True, True, False,
                                                                                      True]
    assert not tenant_usage.reads_whole_bills("key", "bob")
    ticks = iter([0.0, 0.0, 10.0, 10.5])  # the clock at each report's start and end
    clock = ticks.__next__
    place = store.keys.usage_report_hold("acme")

    with tenant_usage.one_report_at_a_time(store, "acme", clock=clock):
        with pytest.raises(QueueFull, match="usage report") as busy:
            with tenant_usage.one_report_at_a_time(store, "acme", clock=clock):
                pass
        assert busy.value.retry_after == tenant_usage.REPORT_RETRY_AFTER_SECONDS
        assert 0 < store.client.pttl(place) <= tenant_usage.REPORT_HOLD_MS  # (a dead process's place lapses)
        with tenant_usage.one_report_at_a_time(store, "globex", clock=lambda: 0.0):  # another tenant's is its own
            pass
    assert not store.client.exists(place)  # it ran no time: no rest
    with pytest.raises(RuntimeError), tenant_usage.one_report_at_a_time(store, "acme", clock=clock):
        raise RuntimeError("a report that ran 0.5 s and failed")

    assert 1000 < store.client.pttl(place) <= 1500  # it rests 3 times as long as it ran
    with pytest.raises(QueueFull):
        with tenant_usage.one_report_at_a_time(store, "acme", clock=clock):
            pass

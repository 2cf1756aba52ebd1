"""Tenants in Redis: records validated together, the file winning, fair-share leasing, max_queued,
max_inflight and the bills of usage (real Redis)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from broker.errors import BadInput, Conflict, NotFound
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import tenant_quotas
from broker.online import requests
from broker.online.requests import QueueAtLimit, RequestResult, RequestSpec
from broker.queueing import leases, reaping, tenant_index
from broker.state.store import Store
from broker.tenants import records as tenants
from broker.tenants import usage as tenant_usage
from broker.tenants.records import TenantTable
from broker.tenants.settings import Tenant
from broker.tenants.usage import BillEntry
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items

MODEL = "mlp@v1"


def request(request_id: str, tenant: str, *, rows: int = 1) -> RequestSpec:
    return RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"x": np.zeros((rows, 4), np.float32)}, rows=rows, tokens=None, bucket="x:4",
                       factors={"enqueued_at": NOW}, owner=f"{tenant}-key", tenant=tenant)


def submit(store: Store, request_id: str, tenant: str, *, score: float, max_queued: int = 0) -> None:
    requests.submit_request(store, request(request_id, tenant), score=score, now=NOW, max_age_seconds=600,
                            tenant_max_queued=max_queued)


# --- records ----------------------------------------------------------------------------------------


def test_a_stored_tenant_is_read_back_over_the_file_s_and_the_file_wins_its_names(store: Store) -> None:
    configured = {"s1": Tenant(guaranteed_share=0.7, limit=1.2, preemption_target=0.005)}
    tenants.save_tenants(store, {"s2": tenants.parse_tenant("s2", {"guaranteed_share": 0.3, "limit": 3.0,
                                                                   "preemption_target": "200ms"})},
                         configured=configured)
    table = TenantTable(configured)

    assert table.tenants(store) == {"s1": configured["s1"], "s2": Tenant(guaranteed_share=0.3, limit=3.0,
                                                                         preemption_target=0.2)}
    with pytest.raises(Conflict, match="tenant 's1' is set in the configuration file"):
        tenants.save_tenants(store, {"s1": Tenant()}, configured=configured)
    with pytest.raises(Conflict, match="remove it there"):
        tenants.delete_tenant(store, "s1", configured=configured)


def test_shares_past_the_whole_fleet_are_refused_naming_the_tenant_and_nothing_is_stored(store: Store) -> None:
    configured = {"s1": Tenant(guaranteed_share=0.7)}

    with pytest.raises(BadInput, match="tenant 'big': guaranteed shares sum to 1.300"):
        tenants.save_tenants(store, {"big": Tenant(guaranteed_share=0.6)}, configured=configured)
    assert tenants.load_tenants(store) == {}
    with pytest.raises(BadInput, match="tenant 'x': limit: Input should be greater than or equal to 1"):
        tenants.parse_tenant("x", {"limit": 0.5})
    with pytest.raises(BadInput, match="tenant name 'a b' must be letters"):
        tenants.parse_tenant("a b", {})
    with pytest.raises(NotFound, match="no tenant 'ghost'"):
        tenants.delete_tenant(store, "ghost", configured={})


def test_two_admins_adding_shares_at_once_cannot_both_take_the_last_of_the_fleet(store: Store) -> None:
    start = threading.Barrier(6)
    refused: list[str] = []

    def add(name: str) -> None:
        start.wait()
        try:
            tenants.save_tenants(store, {name: Tenant(guaranteed_share=0.4)}, configured={})
        except BadInput:
            refused.append(name)

    threads = [threading.Thread(target=add, args=(f"t{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(tenants.load_tenants(store)) == 2 and len(refused) == 4  # 0.8 of the fleet; a third: 1.2


# --- fair share in lease_batch.lua ------------------------------------------------------------------


def lease(store: Store, option: dict | None, *, max_items: int = 2) -> list[str]:
    return [item.item_id for item in lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=max_items,
                                                        tenants=option)]


def test_the_first_ranked_tenant_s_work_goes_first_in_its_own_queue_order(store: Store) -> None:
    for index, (request_id, tenant) in enumerate([("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a"), ("b2", "b")]):
        submit(store, request_id, tenant, score=index)

    assert lease(store, {"order": ["b", "a"], "held": [], "window": 16}) == ["b1", "b2"]
    assert lease(store, {"order": ["b", "a"], "held": [], "window": 16}) == ["a1", "a2"]
    assert lease(store, None) == ["a3"]  # without the option: the queue's order


def test_a_batch_takes_other_tenants_requests_after_the_first_s_and_a_held_tenant_s_none(store: Store) -> None:
    for index, (request_id, tenant) in enumerate([("a1", "a"), ("c1", "c"), ("b1", "b"), ("a2", "a")]):
        submit(store, request_id, tenant, score=index)

    # b ranks first; c has no rank (no share): after every ranked tenant; a is held
    assert lease(store, {"order": ["b"], "held": ["a"], "window": 16}, max_items=4) == ["b1", "c1"]
    store.client.delete(store.keys.doorbell)
    assert lease(store, {"order": [], "held": ["a"], "window": 16}, max_items=4) == []  # only a's work waits
    assert store.client.zrange(store.keys.ready(MODEL), 0, -1) == ["a1", "a2"]  # nothing lost
    assert store.client.llen(store.keys.doorbell) == 0  # an empty lease wakes no idle peer (no busy loop)


def test_fair_share_finds_ranked_tenants_past_its_window_and_others_only_within_it(store: Store) -> None:
    for index in range(8):
        submit(store, f"a{index}", "a", score=index)
    submit(store, "b0", "b", score=100)
    submit(store, "c0", "c", score=101)

    # b's own index finds its request behind the window; c, not in the order, is looked for only within it
    assert lease(store, {"order": ["b", "a"], "held": [], "window": 4}, max_items=1) == ["b0"]
    assert lease(store, {"order": [], "held": ["a"], "window": 4}, max_items=1) == []
    assert lease(store, {"order": [], "held": ["a"], "window": 16}, max_items=1) == ["c0"]


def test_a_queue_stored_before_the_tenant_indexes_is_weighed_by_its_window_until_a_reaper_pass_builds_them(
        store: Store) -> None:
    for index in range(8):
        submit(store, f"a{index}", "a", score=index)
    submit(store, "b0", "b", score=100)
    old_keys = [store.keys.ready_of_tenant(MODEL, "a"), store.keys.ready_of_tenant(MODEL, "b"),
                store.keys.ready_of_tenant_built(MODEL)]
    store.client.delete(*old_keys)  # (as a version before the indexes left it)

    assert lease(store, {"order": ["b", "a"], "held": [], "window": 4}, max_items=1) == ["a0"]
    assert tenant_index.index_waiting_items(store, page=2)  # (a queue this small is one ZSCAN page)
    assert store.client.zrange(store.keys.ready_of_tenant(MODEL, "a"), 0, -1) == [f"a{i}" for i in range(1, 8)]
    assert lease(store, {"order": ["b", "a"], "held": [], "window": 4}, max_items=1) == ["b0"]


def test_job_chunks_carry_their_tenant_and_follow_the_order_too(store: Store) -> None:
    spec = jobs.JobSpec(job_id="jobA", model_name="mlp", model_version="v1", input_batch="/in.npy", input_format="npy",
                        input_checksum="sha256:0", output_dir="/out", output_names=["y"], rows_total=4, chunk_size=2,
                        batch_size=2, owner="alice", tenant="acme")
    job_fills.create_job(store, spec, now=NOW)
    submit(store, "g1", "globex", score=1e12)  # behind both chunks in the queue's order

    assert lease(store, {"order": ["globex", "acme"], "held": [], "window": 16}, max_items=1) == ["g1"]
    [chunk] = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1,
                                 tenants={"order": ["globex", "acme"], "held": [], "window": 16})
    assert (chunk.payload["tenant"], chunk.payload["owner"]) == ("acme", "alice")
    assert jobs.get_job(store, "jobA", now=NOW).tenant == "acme"


def test_a_tenant_s_work_behind_pages_of_another_s_chunks_is_found(store: Store) -> None:
    def job(job_id: str, tenant: str) -> None:
        job_fills.create_job(store, jobs.JobSpec(
            job_id=job_id, model_name="mlp", model_version="v1", input_batch="/in.npy", input_format="npy",
            input_checksum="sha256:0", output_dir="/out", output_names=["y"], rows_total=300, chunk_size=1,
            batch_size=1, owner=f"{tenant}-key", tenant=tenant), now=NOW)

    job("first", "acme")  # 300 chunks ahead in the queue (earlier, same priority)
    job("second", "globex")
    assert store.client.zrank(store.keys.ready(MODEL), "second:c0000000") == 300

    order = {"order": ["globex", "acme"], "held": [], "window": 4096}
    assert lease(store, order, max_items=1) == ["second:c0000000"]
    assert lease(store, order | {"order": ["acme", "globex"]}, max_items=1) == ["first:c0000000"]


# --- max_queued ---------------------------------------------------------------------------------------


def test_a_tenant_at_max_queued_gets_nothing_queued_until_one_of_its_requests_is_answered(store: Store) -> None:
    submit(store, "r1", "acme", score=1, max_queued=2)
    submit(store, "r2", "acme", score=2, max_queued=2)
    submit(store, "other", "globex", score=3, max_queued=2)  # another tenant's count is its own

    with pytest.raises(QueueAtLimit) as full:
        submit(store, "r3", "acme", score=3, max_queued=2)
    assert (full.value.waiting, full.value.tenant) == (2, True)
    assert not store.client.exists(store.keys.request("r3"))

    [first] = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1)
    requests.complete_requests(store, [RequestResult(first, error="bad row", code="bad_input")], now=NOW,
                               keep_seconds=60, batch_size=1, worker="w")
    submit(store, "r3", "acme", score=3, max_queued=2)  # r1 answered (failed): a place is free
    assert store.client.zcard(store.keys.tenant_queued("acme")) == 2
    day = tenant_usage.day_number(NOW)
    [by_model] = tenant_usage.usage_report(store, ["acme"], first_day=day, last_day=day, by="model", prices={})
    assert (by_model["model"], by_model["failed"]) == (MODEL, 1)  # each arm's errors, on the tenant's bill


def test_a_completion_the_script_skips_neither_frees_a_place_nor_bills_a_failure(store: Store) -> None:
    submit(store, "r1", "acme", score=1, max_queued=1)
    leased = lease_items(store, MODEL, now=NOW, lease_seconds=1, max_items=1)
    reaping.reap_expired_leases(store, now=NOW + 5, max_attempts=5)  # the lease was lost: r1 waits again

    late = requests.complete_requests(store, [RequestResult(leased[0], error="boom", code="bad_input")],
                                      now=NOW + 5, keep_seconds=60, batch_size=1, worker="w")  # the first worker's

    assert late == 0 and store.client.zcard(store.keys.tenant_queued("acme")) == 1  # r1 still holds its place
    with pytest.raises(QueueAtLimit):
        submit(store, "r2", "acme", score=2, max_queued=1)
    [again] = lease_items(store, MODEL, now=NOW + 5, lease_seconds=30, max_items=1)
    ok = RequestResult(again, outputs={"y": np.ones((1, 1), np.float32)})
    assert requests.complete_requests(store, [ok], now=NOW + 6, keep_seconds=60, batch_size=1, worker="w") == 1
    assert requests.complete_requests(store, [RequestResult(again, error="boom", code="bad_input")], now=NOW + 7,
                                      keep_seconds=60, batch_size=1, worker="w") == 0  # a repeat: skipped
    day = tenant_usage.day_number(NOW)
    assert not store.client.hget(store.keys.tenant_bill("acme", day), "failed")  # no failure was answered
    assert store.client.zcard(store.keys.tenant_queued("acme")) == 0 and requests.get_request(store, "r1").status \
        == "succeeded"


def test_a_place_held_by_a_request_whose_record_expired_is_freed(store: Store) -> None:
    requests.submit_request(store, request("old", "acme"), score=1, now=NOW, max_age_seconds=60, tenant_max_queued=1)

    with pytest.raises(QueueAtLimit):
        requests.submit_request(store, request("new", "acme"), score=2, now=NOW + 59, max_age_seconds=60,
                                tenant_max_queued=1)
    requests.submit_request(store, request("new", "acme"), score=2, now=NOW + 61, max_age_seconds=60,
                            tenant_max_queued=1)


# --- max_inflight -------------------------------------------------------------------------------------


def test_a_tenant_at_max_inflight_takes_no_place_until_one_of_its_jobs_ends(store: Store) -> None:
    for job_id in ("j1", "j2"):
        tenant_quotas.take_job_place(store, "acme", job_id, most=2, now=NOW)
        store.client.hset(store.keys.job(job_id), "status", "running")

    with pytest.raises(tenant_quotas.TenantAtLimit) as full:
        tenant_quotas.take_job_place(store, "acme", "j3", most=2, now=NOW)
    assert full.value.active == 2
    tenant_quotas.take_job_place(store, "globex", "g1", most=2, now=NOW)  # another tenant's places

    store.client.hset(store.keys.job("j1"), "status", "succeeded")
    tenant_quotas.take_job_place(store, "acme", "j3", most=2, now=NOW)  # j1 ended: its place is j3's
    assert set(store.client.zrange(store.keys.tenant_jobs("acme"), 0, -1)) == {"j2", "j3"}
    with pytest.raises(tenant_quotas.TenantAtLimit):  # j3 is not written yet: its place is kept meanwhile
        tenant_quotas.take_job_place(store, "acme", "j4", most=2, now=NOW + 1)
    tenant_quotas.take_job_place(store, "acme", "j4", most=2, now=NOW + tenant_quotas.PLACE_GRACE_SECONDS + 1)


# --- usage and bills ------------------------------------------------------------------------------------


def test_bills_add_up_by_tenant_model_key_and_device_and_cost_at_the_configured_prices(store: Store) -> None:
    tenant_usage.note_usage(store, [
        BillEntry("acme", "alice", "mlp@v1", "gpu", seconds=3.0, rows=30, requests=3, queue_seconds=0.3),
        BillEntry("acme", "bob", "mlp@v2", "cpu", seconds=1.0, rows=10, requests=1),
        BillEntry("globex", "gary", "mlp@v1", "gpu", seconds=2.0, rows=20),
    ], now=NOW, half_life=30)
    tenant_usage.count_job(store, tenant="globex", owner="gary", model="mlp@v1", now=NOW)
    day = tenant_usage.day_number(NOW)
    prices = {"gpu": 3600.0, "cpu": 360.0}  # 1 per gpu-second, 0.1 per cpu-second

    by_tenant = tenant_usage.usage_report(store, ["acme", "globex"], first_day=day, last_day=day, by="tenant",
                                          prices=prices)
    assert by_tenant == [
        {"tenant": "acme", "device_seconds": 4.0, "rows": 40, "requests": 4, "failed": 0, "jobs": 0,
         "queue_seconds": 0.3, "cost": 3.1},
        {"tenant": "globex", "device_seconds": 2.0, "rows": 20, "requests": 0, "failed": 0, "jobs": 1,
         "queue_seconds": 0.0, "cost": 2.0}]
    by_model = tenant_usage.usage_report(store, ["acme"], first_day=day, last_day=day, by="model", prices=prices)
    assert [(row["model"], row["device_seconds"], row["rows"]) for row in by_model] == [("mlp@v1", 3.0, 30),
                                                                                          ("mlp@v2", 1.0, 10)]
    by_device = tenant_usage.usage_report(store, ["acme"], first_day=day, last_day=day, by="device", prices=prices)
    assert [(row["device"], row["cost"]) for row in by_device] == [("cpu", 0.1), ("gpu", 3.0)]
    assert tenant_usage.usage_report(store, ["acme"], first_day=day + 1, last_day=day + 2, by="tenant",
                                     prices=prices) == []
    assert tenant_usage.billed_tenants(store) == ["acme", "globex"]
    with pytest.raises(BadInput, match="is after 'to'"):
        tenant_usage.usage_report(store, ["acme"], first_day=day, last_day=day - 1, by="tenant", prices={})


def test_usage_decays_by_its_half_life_between_bills(store: Store) -> None:
    tenant_usage.note_usage(store, [BillEntry("acme", "a", "m@1", "cpu", seconds=8.0, rows=1)], now=NOW, half_life=10)
    tenant_usage.note_usage(store, [BillEntry("acme", "a", "m@1", "cpu", seconds=1.0, rows=1)], now=NOW + 20,
                            half_life=10)

    usage = tenant_usage.read_usage(store)["acme"]
    assert usage.at == NOW + 20 and usage.value == pytest.approx(8.0 / 4 + 1.0)
    assert tenant_usage.parse_day("1970-01-03", "from", 0) == 2
    with pytest.raises(BadInput, match="from must be a date like"):
        tenant_usage.parse_day("yesterday", "from", 0)


def test_a_requests_only_lease_finds_a_tenant_s_request_behind_thousands_of_chunks(store: Store) -> None:
    job_fills.create_job(store, jobs.JobSpec(
        job_id="flood", model_name="mlp", model_version="v1", input_batch="/in.npy", input_format="npy",
        input_checksum="sha256:0", output_dir="/out", output_names=["y"], rows_total=3000, chunk_size=1,
        batch_size=1, owner="s2-key", tenant="s2"), now=NOW)
    submit(store, "late-s2", "s2", score=1e12)  # behind every chunk
    submit(store, "late-s1", "s1", score=2e12)

    only_s1 = {"order": ["s1"], "held": [], "window": 64, "only": True}
    leased = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=4, requests_only=True,
                                tenants=only_s1)
    assert [item.item_id for item in leased] == ["late-s1"]  # s2's request and chunks left waiting
    both = {"order": ["s1", "s2"], "held": [], "window": 64}
    assert [item.item_id for item in lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=4,
                                                        requests_only=True, tenants=both)] == ["late-s2"]
    assert store.client.zcard(store.keys.ready(MODEL)) == 3000  # the chunks; both requests leased


def test_a_full_scan_tells_which_ranked_tenants_it_found_no_work_of(store: Store) -> None:
    for index in range(3):
        submit(store, f"a{index}", "a", score=index)
    notes = leases.LeaseNotes()

    leased = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1, notes=notes,
                                tenants={"order": ["ghost", "a"], "held": [], "window": 16})
    assert [item.item_id for item in leased] == ["a0"] and notes.absent == ["ghost"]  # read to the end: none of ghost's
    early = leases.LeaseNotes()
    lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=1, notes=early,
                       tenants={"order": ["a", "ghost"], "held": [], "window": 16})
    assert early.absent == []  # stopped at a's work: nothing is known of ghost's

"""A tenant's budget of bytes in Redis (`max_queued_bytes`): a request's inputs, taken atomically at submit,
turned exactly once into its kept result's bytes when it is answered or times out (freed when the result
expires, at the next submit), freed when it outlives its record, and never drifting (real Redis; time
passed in)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import orjson
import pytest

from broker.errors import PayloadTooLarge, StoreFull
from broker.online import requests
from broker.online import timeouts as request_timeouts
from broker.online.requests import RequestResult, RequestSpec, TenantBytesAtLimit, pack_array
from broker.queueing import reaping
from broker.queueing.scoring import Weights
from broker.setting_types import parse_size
from broker.state.store import Store
from broker.tenants.settings import UNCAPPED, UNRECORDED, Tenant
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items

MODEL = "mlp@v1"


def request(request_id: str, tenant: str = "acme", *, rows: int = 1, expires_at: float | None = None) -> RequestSpec:
    return RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"x": np.full((rows, 64), rows, np.float32)}, rows=rows, tokens=None, bucket="x:64",
                       factors={"enqueued_at": NOW}, owner=f"{tenant}-key", tenant=tenant, expires_at=expires_at)


def size_of(spec: RequestSpec) -> int:
    """The bytes its inputs take in its hash, as the submit counts them."""
    return len(orjson.dumps({name: pack_array(array) for name, array in spec.inputs.items()}))


def submit(store: Store, spec: RequestSpec, *, budget: int, now: float = NOW, max_age: float = 600) -> None:
    requests.submit_request(store, spec, score=1, now=now, max_age_seconds=max_age, tenant_max_queued_bytes=budget)


def queued_bytes(store: Store, tenant: str = "acme") -> dict[str, int]:
    """The tenant's bytes HASH as numbers (`total` among them)."""
    return {field: int(value) for field, value in store.client.hgetall(store.keys.tenant_queued_bytes(tenant)).items()}


def kept_size(store: Store, request_id: str) -> int:
    """What a request's kept result counts: the fields and values of its hash, as its answer stored them."""
    return sum(len(field.encode()) + len(value.encode())
               for field, value in store.client.hgetall(store.keys.request(request_id)).items())


def answer(store: Store, now: float, *, max_items: int = 1, error: str = "", keep: float = 60) -> list[str]:
    leased = lease_items(store, MODEL, now=now, lease_seconds=30, max_items=max_items)
    results = [RequestResult(item, error=error, code="bad_input" if error else "",
                             outputs=None if error else {"y": np.ones((1, 1), np.float32)}) for item in leased]
    if results:
        requests.complete_requests(store, results, now=now, keep_seconds=keep, batch_size=len(results), worker="w")
    return [item.item_id for item in leased]


def test_the_default_budget_bounds_a_tenant_and_admins_without_a_record_are_spared() -> None:
    assert UNRECORDED.max_queued_bytes == parse_size("256MiB") and UNCAPPED.max_queued_bytes == 0
    assert Tenant(max_queued_bytes="8MiB").max_queued_bytes == 8 * 2**20  # type: ignore[arg-type]


def test_a_tenant_queues_up_to_its_byte_budget_and_past_it_nothing_but_the_refusal_is_written(store: Store) -> None:
    each = size_of(request("r0"))
    for n in range(3):
        submit(store, request(f"r{n}"), budget=3 * each)
    submit(store, request("g0", "globex"), budget=3 * each)  # another tenant's bytes are its own

    with pytest.raises(TenantBytesAtLimit) as full:
        submit(store, request("r3"), budget=3 * each)

    refused = full.value
    assert (refused.queued_bytes, refused.request_bytes, refused.budget, refused.waiting) == (3 * each, each,
                                                                                               3 * each, 3)
    assert not store.client.exists(store.keys.request("r3")) and store.client.zcard(store.keys.ready(MODEL)) == 4
    assert queued_bytes(store) == {"r0": each, "r1": each, "r2": each, "total": 3 * each}
    assert store.client.zcard(store.keys.tenant_queued("acme")) == 3
    assert store.client.hget(store.keys.counters, f"requests_rejected_tenant_bytes_full:{MODEL}") == "1"


def test_inputs_larger_than_the_whole_budget_are_a_413_that_says_so_not_a_429_forever(store: Store) -> None:
    big = request("big", rows=8)

    with pytest.raises(PayloadTooLarge) as refused:
        submit(store, big, budget=size_of(big) - 1)

    assert "tenants.acme.max_queued_bytes" in str(refused.value) and f"{size_of(big):,} bytes" in str(refused.value)
    assert not store.client.exists(store.keys.request("big"), store.keys.tenant_queued_bytes("acme"))


def test_an_answered_request_counts_its_kept_result_once_until_it_expires_and_a_late_repeat_changes_nothing(
        store: Store) -> None:
    each = size_of(request("r0"))
    for n in range(2):
        submit(store, request(f"r{n}"), budget=2 * each)
    leased = lease_items(store, MODEL, now=NOW, lease_seconds=1, max_items=1)
    reaping.reap_expired_leases(store, now=NOW + 5, max_attempts=5)  # the lease was lost: it waits again
    late = requests.complete_requests(store, [RequestResult(leased[0], error="boom", code="bad_input")],
                                      now=NOW + 5, keep_seconds=60, batch_size=1, worker="w")
    assert late == 0 and queued_bytes(store)["total"] == 2 * each  # a completion the script skipped changes nothing

    [done] = answer(store, NOW + 6, keep=60)
    kept = kept_size(store, done)
    again = lease_items(store, MODEL, now=NOW + 6, lease_seconds=30, max_items=1)  # the other one, leased
    repeat = [RequestResult(leased[0], outputs={"y": np.ones((1, 1), np.float32)})]
    requests.complete_requests(store, repeat, now=NOW + 7, keep_seconds=60, batch_size=1, worker="w")

    assert 0 < kept < each and queued_bytes(store) == {done: kept, again[0].item_id: each, "total": kept + each}
    assert store.client.zrange(store.keys.tenant_kept("acme"), 0, -1, withscores=True) == [(done, NOW + 66)]
    assert store.client.zcard(store.keys.tenant_queued("acme")) == 1  # max_queued counts the unanswered only
    with pytest.raises(TenantBytesAtLimit) as full:  # its kept result still holds bytes in Redis
        submit(store, request("r2"), budget=2 * each, now=NOW + 65)
    assert (full.value.kept, full.value.kept_free_at) == (1, NOW + 66)
    submit(store, request("r2"), budget=2 * each, now=NOW + 66)  # its result expired: its bytes are free
    assert queued_bytes(store) == {again[0].item_id: each, "r2": each, "total": 2 * each}
    assert not store.client.exists(store.keys.tenant_kept("acme"))
    requests.complete_requests(store, [RequestResult(again[0], error="x", code="bad_input")], now=NOW + 67,
                               keep_seconds=60, batch_size=1, worker="w")
    answer(store, NOW + 67)
    submit(store, request("r3"), budget=2 * each, now=NOW + 128)  # both results expired
    assert queued_bytes(store) == {"r3": each, "total": each}


def test_a_waiter_s_inbox_copy_counts_until_the_inbox_would_drop_it(store: Store) -> None:
    each = size_of(request("r0"))
    submit(store, request("waited"), budget=10 * each)
    store.client.hset(store.keys.items, "waited", orjson.dumps(
        {**orjson.loads(store.client.hget(store.keys.items, "waited")), "reply_to": store.keys.inbox("api")}))
    answer(store, NOW, keep=600)

    [copy] = store.client.lrange(store.keys.inbox("api"), 0, -1)
    assert queued_bytes(store) == {"waited": kept_size(store, "waited"), "waited|inbox": len(copy),
                                   "total": kept_size(store, "waited") + len(copy)}
    assert 0 < store.client.ttl(store.keys.inbox("api")) <= requests.INBOX_KEEP_SECONDS
    submit(store, request("next"), budget=10 * each, now=NOW + requests.INBOX_KEEP_SECONDS)
    assert set(queued_bytes(store)) == {"waited", "next", "total"}  # the copy's time passed: freed


def test_a_request_failed_at_its_timeout_frees_its_inputs_for_its_kept_failure(store: Store) -> None:
    each = size_of(request("r0"))
    submit(store, request("late", expires_at=NOW + 1), budget=each)

    done = request_timeouts.expire_timed_out(store, MODEL, now=NOW + 2, weights=Weights(), ordering="dynamic",
                                             keep_seconds=60)

    assert done.rejected == ["late"] and requests.get_request(store, "late").error_code == "timeout"
    assert queued_bytes(store) == {"late": kept_size(store, "late"), "total": kept_size(store, "late")}
    submit(store, request("next"), budget=each, now=NOW + 62)  # its failure expired: the room is back
    assert queued_bytes(store) == {"next": each, "total": each}


def test_bytes_held_by_a_request_whose_record_expired_are_freed_and_its_late_answer_frees_nothing(
        store: Store) -> None:
    each = size_of(request("r0"))
    submit(store, request("old"), budget=2 * each, max_age=60)
    submit(store, request("kept"), budget=2 * each, now=NOW + 30, max_age=60)
    with pytest.raises(TenantBytesAtLimit):
        submit(store, request("new"), budget=2 * each, now=NOW + 59, max_age=60)

    submit(store, request("new"), budget=2 * each, now=NOW + 61, max_age=60)  # old's record is past its expiry

    assert queued_bytes(store) == {"kept": each, "new": each, "total": 2 * each}
    old = [item for item in lease_items(store, MODEL, now=NOW + 62, lease_seconds=30, max_items=3)
           if item.item_id == "old"]
    requests.complete_requests(store, [RequestResult(old[0], error="gone", code="bad_input")], now=NOW + 62,
                               keep_seconds=60, batch_size=1, worker="w")
    assert queued_bytes(store)["total"] == 2 * each  # the expired one was freed once, at the submit


def test_a_full_redis_refuses_the_submit_before_a_byte_is_counted(store: Store) -> None:
    store.client.config_set("maxmemory", "1")  # Redis holds more than that already: every write is refused
    try:
        with pytest.raises(StoreFull):
            submit(store, request("r0"), budget=2**20)
    finally:
        store.client.config_set("maxmemory", "0")

    assert not store.client.exists(store.keys.tenant_queued_bytes("acme"), store.keys.tenant_queued("acme"),
                                   store.keys.request("r0"))


def test_many_submits_answers_and_lost_leases_leave_the_count_exact(store: Store) -> None:
    rng = random.Random(7)
    budget = 5 * size_of(request("r", rows=2))
    keep = 8.0
    expected: dict[str, int] = {}  # request id -> its bytes, of those accepted and not answered
    kept: dict[str, tuple[int, float]] = {}  # request id -> (its kept result's bytes, until), of those answered
    now = NOW
    for step in range(300):
        now += 1
        move = rng.random()
        if move < 0.55:
            spec = request(f"r{step}", rows=rng.randint(1, 4))
            kept = {item_id: entry for item_id, entry in kept.items() if entry[1] > now}  # (a submit frees them)
            if sum(expected.values()) + sum(size for size, _ in kept.values()) + size_of(spec) > budget:
                with pytest.raises(TenantBytesAtLimit):
                    submit(store, spec, budget=budget, now=now)
            else:
                submit(store, spec, budget=budget, now=now)
                expected[spec.request_id] = size_of(spec)
        elif move < 0.85:
            for item_id in answer(store, now, max_items=rng.randint(1, 3), error=rng.choice(["", "bad row"]),
                                  keep=keep):
                del expected[item_id]
                kept[item_id] = (kept_size(store, item_id), now + keep)
        else:
            lease_items(store, MODEL, now=now, lease_seconds=1, max_items=2)
            now += 5
            reaping.reap_expired_leases(store, now=now, max_attempts=1000)  # lost leases: nothing is freed
        held = queued_bytes(store)
        assert held.pop("total", 0) == sum(expected.values()) + sum(size for size, _ in kept.values()), step
        assert held == expected | {item_id: size for item_id, (size, _) in kept.items()}, step
        assert store.client.zcard(store.keys.tenant_queued("acme")) == len(expected)

    while expected:
        now += 1
        for item_id in answer(store, now, max_items=4, keep=keep):
            del expected[item_id]
    submit(store, request("last"), budget=budget, now=now + keep)  # every result kept has expired: all freed
    assert queued_bytes(store) == {"last": size_of(request("last")), "total": size_of(request("last"))}
    assert not store.client.exists(store.keys.tenant_kept("acme"))


def test_answers_as_large_as_their_inputs_count_while_kept_so_a_flood_cannot_fill_redis_with_results(
        store: Store) -> None:
    """An identity-sized model (a tenant may register its own): before, each answer freed its inputs' bytes and
    kept as many in its result, uncounted, for `online.result_ttl`: 40 rounds under a 400 kB budget held 14 MB."""
    big = RequestSpec(request_id="", model_name="mlp", model_version="v1", rows=64, tokens=None, bucket="x:1024",
                      inputs={"x": np.ones((64, 1024), np.float32)}, factors={"enqueued_at": NOW},
                      owner="acme-key", tenant="acme")
    budget = 400_000  # room for one such request (350 kB as base64) at a time
    accepted = []
    for n in range(40):
        spec = replace(big, request_id=f"r{n:016x}")
        try:
            submit(store, spec, budget=budget, now=NOW + n)
        except TenantBytesAtLimit as full:
            assert full.kept == 1 and full.kept_free_at == NOW + 600 and full.waiting == 0
            continue
        accepted.append(spec.request_id)
        [item] = lease_items(store, MODEL, now=NOW + n, lease_seconds=30, max_items=1)
        requests.complete_requests(store, [RequestResult(item, outputs={"y": np.ones((64, 1024), np.float32)})],
                                   now=NOW + n, keep_seconds=600, batch_size=1, worker="w", run_started=NOW + n,
                                   run_rows=64)

    assert accepted == ["r0000000000000000"]  # its result holds the budget until it expires
    held = sum(store.client.memory_usage(store.keys.request(request_id), samples=0) for request_id in accepted)
    assert held <= 1.01 * budget and queued_bytes(store)["total"] == kept_size(store, accepted[0])
    submit(store, replace(big, request_id="r-after"), budget=budget, now=NOW + 600)  # expired: room again

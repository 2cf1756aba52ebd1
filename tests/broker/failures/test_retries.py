"""Retried items wait out their backoff in Redis and keep their place; every failure is recorded by
class on its job's or request's record; lost leases count apart (real Redis, time passed in)."""

from __future__ import annotations

import numpy as np

from broker.failures import retries
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases, reaping, tickets
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, inflight_deadlines, job_field, job_spec, ready_ids
from tests.leasing import lease_items


def _lease_all(store: Store, now: float, model_ref: str = MODEL_REF) -> dict[str, leases.LeasedItem]:
    leased = lease_items(store, model_ref, now=now, lease_seconds=30, max_items=100)
    return {item.item_id: item for item in leased}


def test_a_retried_chunk_waits_in_flight_then_returns_at_its_own_score_ahead_of_later_work(store: Store) -> None:
    first, later = job_spec(rows_total=4, chunk_size=4, priority=5), job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, first, now=NOW)
    [item] = _lease_all(store, NOW).values()
    score = store.client.zscore(store.keys.ready(MODEL_REF), item.item_id) or item.payload["score"]
    job_fills.create_job(store, later, now=NOW + 1)  # comes in while the first one waits

    outcome = retries.retry_later(store, item, failure_class="device_oom", error="device out of memory",
                                  delays=[1.0, 4.0, 16.0], now=NOW + 2)

    assert outcome.retried and outcome.failures == 1 and outcome.retry_at == NOW + 3
    assert inflight_deadlines(store)[item.item_id] == NOW + 3  # parked: no worker thread waits
    assert reaping.reap_expired_leases(store, now=NOW + 2.9, max_attempts=3).returned == 0
    assert ready_ids(store) == [jobs.chunk_item_id(later.job_id, 0)]
    result = reaping.reap_expired_leases(store, now=NOW + 3.0, max_attempts=3)
    assert result.returned == 1 and result.lost == []  # a retry, not a lost worker
    assert ready_ids(store) == [item.item_id, jobs.chunk_item_id(later.job_id, 0)]
    assert store.client.zscore(store.keys.ready(MODEL_REF), item.item_id) == score
    assert store.client.zcard(store.keys.retrying(MODEL_REF)) == 0


def test_each_failure_of_a_class_takes_the_next_wait_until_its_attempts_are_used_up(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    now, outcomes = NOW, []
    for _ in range(3):
        [item] = _lease_all(store, now).values()
        outcomes.append(retries.retry_later(store, item, failure_class="run_timeout", error=f"timed out at {now}",
                                            delays=[1.0, 4.0], now=now))
        now = (outcomes[-1].retry_at or now) + 0.5
        reaping.reap_expired_leases(store, now=now, max_attempts=3)

    assert [(o.retried, o.failures, o.retry_at) for o in outcomes] == [
        (True, 1, NOW + 1), (True, 2, NOW + 1.5 + 4), (False, 3, None)]
    job = jobs.get_job(store, spec.job_id, now=now)
    assert job.retries == {"run_timeout": {"attempts": 3, "last_error": f"timed out at {NOW + 6}",
                                              "last_failed_at": NOW + 6}}
    assert [(entry["class"], entry["at"], entry["retry_at"]) for entry in job.failures] == [
        ("run_timeout", NOW, NOW + 1), ("run_timeout", NOW + 1.5, NOW + 5.5), ("run_timeout", NOW + 6, None)]
    raw_counts = ("item:", "attempts:", "error:", "failed_at:")
    assert not any(name.startswith(raw_counts) for name in job.to_json())


def test_a_class_that_is_never_retried_fails_at_its_first_failure(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = _lease_all(store, NOW).values()

    outcome = retries.retry_later(store, item, failure_class="bad_input", error="row 3 is bad", delays=[], now=NOW)

    assert not outcome.retried and outcome.failures == 1 and not outcome.gone
    assert jobs.get_job(store, spec.job_id, now=NOW).retries["bad_input"]["attempts"] == 1


def test_retries_count_per_item_and_class_while_the_job_record_sums_them(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    first, second = _lease_all(store, NOW).values()

    assert retries.retry_later(store, first, failure_class="transient", error="EIO", delays=[2.0], now=NOW).retried
    assert retries.retry_later(store, second, failure_class="transient", error="EIO", delays=[2.0], now=NOW).retried
    assert retries.retry_later(store, first, failure_class="device_oom", error="oom", delays=[], now=NOW).failures == 1

    counts = jobs.get_job(store, spec.job_id, now=NOW).retries
    assert counts["transient"]["attempts"] == 2 and counts["device_oom"]["attempts"] == 1


def test_a_parked_lease_is_not_a_lost_one_and_does_not_count_against_lost_attempts(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    now = NOW
    for _ in range(4):  # four leases, each failing in a class with retries left
        [item] = _lease_all(store, now).values()
        retries.retry_later(store, item, failure_class="transient", error="EIO", delays=[0.0] * 5, now=now)
        now += 1
        assert reaping.reap_expired_leases(store, now=now, max_attempts=2).dead_items == []

    assert job_field(store, spec.job_id, "attempts:worker_lost") is None


def test_a_lost_lease_is_recorded_as_worker_lost_and_queued_again_at_once(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = _lease_all(store, NOW).values()

    result = reaping.reap_expired_leases(store, now=NOW + 31, max_attempts=3)
    retries.note_lost(store, result.lost, now=NOW + 31, error="its lease expired")

    assert result.returned == 1 and [(ref, item_id, at) for ref, item_id, _, at in result.lost] == [
        (MODEL_REF, item.item_id, None)]
    assert ready_ids(store) == [item.item_id]
    job = jobs.get_job(store, spec.job_id, now=NOW + 31)
    assert job.retries["worker_lost"]["attempts"] == 1
    assert job.failures[-1]["retry_at"] == NOW + 31


def test_a_lost_lease_may_wait_a_backoff_of_its_own(store: Store) -> None:
    job_fills.create_job(store, job_spec(rows_total=4, chunk_size=4), now=NOW)
    [item] = _lease_all(store, NOW).values()

    result = reaping.reap_expired_leases(store, now=NOW + 31, max_attempts=3, lost_delays=[5.0])

    assert result.returned == 0 and result.lost[0][3] == NOW + 36
    assert reaping.reap_expired_leases(store, now=NOW + 35, max_attempts=3).returned == 0
    again = reaping.reap_expired_leases(store, now=NOW + 36, max_attempts=3)
    assert again.returned == 1 and again.lost == [] and ready_ids(store) == [item.item_id]


def test_a_stopped_job_s_parked_item_is_gone_and_leaves_no_mark(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = _lease_all(store, NOW).values()
    retries.retry_later(store, item, failure_class="device_oom", error="oom", delays=[10.0], now=NOW)

    job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 1)
    reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)

    assert ready_ids(store) == [] and inflight_deadlines(store) == {}
    assert store.client.zcard(store.keys.retrying(MODEL_REF)) == 0
    late = retries.retry_later(store, item, failure_class="device_oom", error="oom", delays=[10.0], now=NOW + 12)
    assert late.gone


def test_a_request_s_failures_are_counted_on_its_own_record(store: Store) -> None:
    spec = RequestSpec(request_id=requests.new_request_id(), model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 4), np.float32)}, rows=1, tokens=None, bucket="b",
                       factors={"level": 0})
    requests.submit_request(store, spec, score=1.0, now=NOW, max_age_seconds=60)
    [item] = _lease_all(store, NOW).values()

    outcome = retries.retry_later(store, item, failure_class="device_oom", error="oom", delays=[1.0], now=NOW)
    reaping.reap_expired_leases(store, now=NOW + 1, max_attempts=3)
    [again] = _lease_all(store, NOW + 1).values()
    last = retries.retry_later(store, again, failure_class="device_oom", error="oom 2", delays=[1.0], now=NOW + 1)

    assert outcome.retried and not last.retried and last.failures == 2
    record = requests.get_request(store, spec.request_id)
    assert record.retries == {"device_oom": {"attempts": 2, "last_error": "oom 2", "last_failed_at": NOW + 1}}
    assert [entry["retry_at"] for entry in record.failures] == [NOW + 1, None]


def test_a_resumed_job_starts_its_chunks_on_fresh_attempts_and_keeps_its_history(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = _lease_all(store, NOW).values()
    assert not retries.retry_later(store, item, failure_class="device_oom", error="oom", delays=[], now=NOW).retried
    job_stops.stop_job(store, spec.job_id, status="failed", error="oom", now=NOW)

    job_fills.resume_job(store, spec.job_id, now=NOW + 1)
    [again] = _lease_all(store, NOW + 1).values()
    outcome = retries.retry_later(store, again, failure_class="device_oom", error="oom", delays=[1.0], now=NOW + 1)

    assert outcome.retried and outcome.failures == 1
    assert jobs.get_job(store, spec.job_id, now=NOW + 1).retries["device_oom"]["attempts"] == 2


def test_a_mark_left_by_a_stopped_job_does_not_pass_its_next_lost_lease_off_as_a_retry(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = _lease_all(store, NOW).values()
    retries.retry_later(store, item, failure_class="device_oom", error="oom", delays=[100.0], now=NOW)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 1)
    job_fills.resume_job(store, spec.job_id, now=NOW + 2)
    _lease_all(store, NOW + 2)  # its worker is lost: the lease runs out at NOW + 32

    result = reaping.reap_expired_leases(store, now=NOW + 200, max_attempts=3)

    assert [item_id for _, item_id, _, _ in result.lost] == [item.item_id]
    assert store.client.zcard(store.keys.retrying(MODEL_REF)) == 0




def test_extending_leases_moves_running_ones_and_the_ticket_but_not_a_parked_retry_or_a_reaped_one(
        store: Store) -> None:
    for index in range(3):
        job_fills.create_job(store, job_spec(f"j{index}", rows_total=4, chunk_size=4), now=NOW)
    running, parked, reaped = _lease_all(store, NOW).values()
    [ticket] = tickets.top_up_tickets(store, now=NOW, target=1)
    retries.retry_later(store, parked, failure_class="device_oom", error="device out of memory", delays=[1.0],
                        now=NOW + 5)  # may run again at NOW + 6

    leases.extend_leases(store, [running, parked], ticket, now=NOW + 5.5, lease_seconds=30)  # (a keeper's beat)

    assert inflight_deadlines(store) == {running.item_id: NOW + 35.5, parked.item_id: NOW + 6,
                                         reaped.item_id: NOW + 30}
    assert store.client.zscore(store.keys.tickets, ticket) == NOW + 5.5
    result = reaping.reap_expired_leases(store, now=NOW + 7, max_attempts=3)
    assert result.returned == 1 and result.lost == []  # the retry, on time, and not taken for a lost lease
    reaping.reap_expired_leases(store, now=NOW + 31, max_attempts=3)  # `reaped`'s lease ran out
    leases.extend_leases(store, [running, reaped], "", now=NOW + 32, lease_seconds=30)
    assert inflight_deadlines(store) == {running.item_id: NOW + 62}  # a reaped lease stays reaped
    assert set(ready_ids(store)) == {parked.item_id, reaped.item_id}

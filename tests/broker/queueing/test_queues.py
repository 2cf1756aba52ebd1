"""Leases, acks, the reaper and batch tickets, against a real Redis with time passed in."""

from __future__ import annotations

import json

import pytest

from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.queueing import leases, queues, reaping, tickets, workers
from broker.queueing.leases import StaleTicket
from broker.queueing.wakeup import wake_workers
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, ack, inflight_deadlines, job_field, job_spec, ready_ids
from tests.leasing import lease_items

# --- leasing ------------------------------------------------------------------------------


def test_lease_moves_items_from_ready_to_inflight_with_the_deadline(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4)  # chunks [0,4) [4,8) [8,10)
    job_fills.create_job(store, spec, now=NOW)

    leased = lease_items(store, MODEL_REF, now=NOW + 1, lease_seconds=30, max_items=2)

    assert [item.item_id for item in leased] == [jobs.chunk_item_id(spec.job_id, i) for i in (0, 1)]
    assert ready_ids(store) == [jobs.chunk_item_id(spec.job_id, 2)]
    assert inflight_deadlines(store) == {item.item_id: NOW + 31 for item in leased}
    first = leased[0]
    assert first.model_ref == MODEL_REF
    assert first.attempts == 1
    assert first.payload | {"score": None} == {
        "kind": "chunk",
        "job": spec.job_id,
        "model_ref": MODEL_REF,
        "chunk": 0,
        "start": 0,
        "stop": 4,
        "batch_size": 2,
        "score": None,
        "factors": jobs.job_factors(0, NOW).to_dict(),
        "tenant": "alice",  # (the owner's name: the job's key has no tenant of its own)
        "owner": "alice",
    }


def test_lease_on_an_empty_or_unknown_queue_returns_nothing(store: Store) -> None:
    assert lease_items(store, "nobody@v0", now=NOW, lease_seconds=30, max_items=8) == []


def test_lease_takes_at_most_what_is_waiting(store: Store) -> None:
    job_fills.create_job(store, job_spec(rows_total=3, chunk_size=2), now=NOW)

    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=10)

    assert len(leased) == 2
    assert ready_ids(store) == []


def test_items_are_leased_fifo_within_a_priority(store: Store) -> None:
    first = job_spec("jfirst", rows_total=4, chunk_size=2)
    second = job_spec("jsecond", rows_total=4, chunk_size=2)
    job_fills.create_job(store, second, now=NOW + 5)  # written to Redis first ...
    job_fills.create_job(store, first, now=NOW)  # ... but this one was enqueued earlier

    leased = lease_items(store, MODEL_REF, now=NOW + 10, lease_seconds=30, max_items=10)

    assert [item.item_id for item in leased] == [
        "jfirst:c0000000",
        "jfirst:c0000001",
        "jsecond:c0000000",
        "jsecond:c0000001",
    ]


def test_higher_priority_is_leased_first_even_when_enqueued_later(store: Store) -> None:
    job_fills.create_job(store, job_spec("jlow", rows_total=2, chunk_size=1, priority=0), now=NOW)
    job_fills.create_job(store, job_spec("jmid", rows_total=1, chunk_size=1, priority=5), now=NOW + 5)
    job_fills.create_job(store, job_spec("jhigh", rows_total=1, chunk_size=1, priority=15), now=NOW + 10)

    order = [
        item.item_id for item in lease_items(store, MODEL_REF, now=NOW + 200, lease_seconds=30, max_items=10)
    ]

    assert order == ["jhigh:c0000000", "jmid:c0000000", "jlow:c0000000", "jlow:c0000001"]


def test_aging_lets_an_old_low_priority_item_pass_newer_urgent_ones(store: Store) -> None:
    job_fills.create_job(store, job_spec("jold", rows_total=1, chunk_size=1, priority=0), now=NOW)
    # delta = 0.1 point per second: after 60 s the old item is worth 6 levels more than a new one
    job_fills.create_job(store, job_spec("jnew", rows_total=1, chunk_size=1, priority=5), now=NOW + 60)

    order = [item.item_id for item in lease_items(store, MODEL_REF, now=NOW + 61, lease_seconds=30,
                                                         max_items=10)]

    assert order == ["jold:c0000000", "jnew:c0000000"]


def test_chunks_of_a_large_job_wait_in_row_order(store: Store) -> None:
    spec = job_spec(rows_total=25, chunk_size=2)  # 13 chunks: ids must sort numerically
    job_fills.create_job(store, spec, now=NOW)

    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=100)

    assert [item.payload["chunk"] for item in leased] == list(range(13))


def test_queue_heads_and_depths_report_each_queue(store: Store) -> None:
    job_fills.create_job(store, job_spec("ja", rows_total=4, chunk_size=2), now=NOW)
    job_fills.create_job(store, job_spec("jb", model_name="cnn", rows_total=3, chunk_size=1), now=NOW + 1)
    lease_items(store, "cnn@v1", now=NOW + 2, lease_seconds=30, max_items=3)

    heads = queues.queue_heads(store)
    depths = queues.queue_depths(store)

    assert list(heads) == [MODEL_REF]  # cnn's queue has nothing waiting
    assert heads[MODEL_REF] == store.client.zscore(store.keys.ready(MODEL_REF), "ja:c0000000")
    assert depths == {"cnn@v1": {"ready": 0, "inflight": 3}, MODEL_REF: {"ready": 2, "inflight": 0}}


def test_a_watcher_sees_heads_deadlines_and_the_policy_and_picks_up_queues_created_after_it(store: Store) -> None:
    watcher = queues.QueueWatcher(store)
    empty = watcher.snapshot()
    assert (empty.heads, empty.head_items, empty.earliest_deadlines, empty.raw_policy) == ({}, {}, {}, "")

    job_fills.create_job(store, job_spec("ja", rows_total=4, chunk_size=2), now=NOW)
    job_fills.create_job(store, job_spec("jb", model_name="cnn", rows_total=1, chunk_size=1), now=NOW)
    store.client.zadd(store.keys.deadlines(MODEL_REF), {"ja:c0000001": NOW + 2.5, "ja:c0000000": NOW + 7})
    store.client.set(store.keys.policy, '{"ordering": "fifo"}')
    lease_items(store, "cnn@v1", now=NOW, lease_seconds=30, max_items=1)
    seen = watcher.snapshot()

    assert seen.heads == {MODEL_REF: store.client.zscore(store.keys.ready(MODEL_REF), "ja:c0000000")}
    assert seen.head_items == {MODEL_REF: "ja:c0000000"}  # cnn's queue exists but has nothing waiting
    assert seen.earliest_deadlines == {MODEL_REF: NOW + 2.5}
    assert seen.raw_policy == '{"ordering": "fifo"}'


# --- the reaper -----------------------------------------------------------------------------


def test_expired_lease_returns_item_to_its_queue(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    score_before = store.client.zscore(store.keys.ready(MODEL_REF), jobs.chunk_item_id(spec.job_id, 0))
    [item] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)

    early = reaping.reap_expired_leases(store, now=NOW + 29, max_attempts=3)
    assert early.returned == 0
    assert item.item_id in inflight_deadlines(store)

    late = reaping.reap_expired_leases(store, now=NOW + 31, max_attempts=3)

    assert late.returned == 1
    assert late.dead_items == []
    assert inflight_deadlines(store) == {}
    assert ready_ids(store) == [item.item_id, jobs.chunk_item_id(spec.job_id, 1)]  # back at the head
    assert store.client.zscore(store.keys.ready(MODEL_REF), item.item_id) == score_before


def test_re_leased_item_counts_its_attempts(store: Store) -> None:
    job_fills.create_job(store, job_spec(rows_total=1, chunk_size=1), now=NOW)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=1)
    reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)

    [again] = lease_items(store, MODEL_REF, now=NOW + 12, lease_seconds=10, max_items=1)

    assert again.attempts == 2


def test_item_leased_max_attempts_times_lands_in_the_dead_set(store: Store) -> None:
    spec = job_spec(rows_total=1, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    now = NOW
    results = []
    for _ in range(3):
        [item] = lease_items(store, MODEL_REF, now=now, lease_seconds=10, max_items=1)
        now += 11
        results.append(reaping.reap_expired_leases(store, now=now, max_attempts=3))

    assert [r.returned for r in results] == [1, 1, 0]
    assert results[-1].dead_items == [(MODEL_REF, item.item_id, item.payload)]
    assert item.attempts == 3
    assert ready_ids(store) == []
    assert inflight_deadlines(store) == {}
    assert store.client.zrange(store.keys.dead, 0, -1) == [item.item_id]


def test_finish_item_clears_a_dead_item_and_fails_its_job(store: Store) -> None:
    spec = job_spec(rows_total=1, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=1)
    [(model_ref, item_id, payload)] = reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=1).dead_items

    item = leases.LeasedItem(item_id, model_ref, payload, 1)
    leases.finish_item(store, item, spec.job_id, now=NOW + 12, job_status="failed", error="poison")

    assert store.client.zcard(store.keys.dead) == 0
    assert store.client.hget(store.keys.items, item_id) is None
    assert store.client.hget(store.keys.attempts, item_id) is None
    assert job_field(store, spec.job_id, "status") == "failed"
    assert job_field(store, spec.job_id, "error") == "poison"


def test_finish_item_keeps_a_final_job_status(store: Store) -> None:
    spec = job_spec(rows_total=2, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    [item, _] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=2)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="by user", now=NOW + 1)

    leases.finish_item(store, item, spec.job_id, now=NOW + 2, job_status="failed", error="late failure")

    assert job_field(store, spec.job_id, "status") == "cancelled"
    assert job_field(store, spec.job_id, "error") == "by user"


def test_an_item_dropped_for_a_stopped_job_that_a_resume_queued_again_stays_queued_or_leased(
        store: Store) -> None:
    """The worker saw the job cancelled and drops its item; a resume in between queued it again: were it
    removed, the resumed job would wait for ever for a chunk that is nowhere."""
    spec = job_spec(rows_total=2, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    [item, other] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=2)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="by user", now=NOW + 1)
    job_fills.resume_job(store, spec.job_id, now=NOW + 2)

    leases.finish_item(store, item, spec.job_id, now=NOW + 3)  # the late drop

    assert sorted(ready_ids(store)) == sorted([item.item_id, other.item_id])
    assert store.client.hget(store.keys.items, item.item_id) is not None
    again = lease_items(store, MODEL_REF, now=NOW + 4, lease_seconds=10, max_items=2)  # another worker's
    leases.finish_item(store, item, spec.job_id, now=NOW + 4)  # a drop later still
    assert sorted(inflight_deadlines(store)) == sorted(leased.item_id for leased in again)
    assert store.client.hget(store.keys.items, item.item_id) is not None
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="again", now=NOW + 4)
    leases.finish_item(store, item, spec.job_id, now=NOW + 5)  # a drop of a stopped job's item removes it
    assert store.client.hget(store.keys.items, item.item_id) is None


# --- acks ---------------------------------------------------------------------------------------


def test_ack_records_the_chunk_in_the_job_checkpoint(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)

    assert ack(store, item, now=NOW + 5, worker="gpu0") == 1

    assert inflight_deadlines(store) == {}
    assert store.client.hget(store.keys.items, item.item_id) is None
    assert store.client.hget(store.keys.attempts, item.item_id) is None
    assert job_progress.done_chunks(store, spec.job_id) == {0}
    job = jobs.get_job(store, spec.job_id, now=NOW + 5)
    assert (job.chunks_done, job.rows_done, job.chunk_runs) == (1, 4, 1)
    assert job.status == "running"
    assert job.checkpoint_ts == NOW + 5
    assert job.workers == {"gpu0": 1}
    assert job.progress == 0.4


def test_acking_the_same_chunk_twice_counts_it_once(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)

    first = ack(store, item, now=NOW + 1)
    second = ack(store, item, now=NOW + 2)

    assert (first, second) == (1, 0)
    job = jobs.get_job(store, spec.job_id, now=NOW + 2)
    assert (job.chunks_done, job.rows_done, job.chunk_runs) == (1, 4, 2)
    assert job.checkpoint_ts == NOW + 1
    assert job_progress.done_chunks(store, spec.job_id) == {0}


def test_late_ack_of_a_reaped_chunk_takes_it_out_of_the_queue(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [slow] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=1)
    reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)
    assert slow.item_id in ready_ids(store)

    assert ack(store, slow, now=NOW + 12) == 1  # the slow worker finished after all

    assert slow.item_id not in ready_ids(store)  # so nobody runs it again
    assert job_progress.done_chunks(store, spec.job_id) == {0}


def test_late_ack_after_the_chunk_was_re_leased_is_counted_once(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [slow] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=10, max_items=1)
    reaping.reap_expired_leases(store, now=NOW + 11, max_attempts=3)
    [fast] = lease_items(store, MODEL_REF, now=NOW + 12, lease_seconds=10, max_items=1)

    replies = [ack(store, slow, now=NOW + 13), ack(store, fast, now=NOW + 14)]

    assert replies == [2, 0]  # the first ack was the job's last chunk; the duplicate is ignored
    assert jobs.get_job(store, spec.job_id, now=NOW + 14).chunks_done == 1
    assert ready_ids(store) == [jobs.finalize_item_id(spec.job_id)]  # finalize queued exactly once


def test_last_chunk_ack_queues_the_finalize_item(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4, priority=3)
    job_fills.create_job(store, spec, now=NOW)
    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=3)

    replies = [ack(store, item, now=NOW + 1) for item in reversed(leased)]

    assert replies == [1, 1, 2]
    finalize_id = jobs.finalize_item_id(spec.job_id)
    assert ready_ids(store) == [finalize_id]
    payload = json.loads(store.client.hget(store.keys.items, finalize_id))
    assert payload == {
        "kind": "finalize",
        "job": spec.job_id,
        "model_ref": MODEL_REF,
        "score": leased[0].payload["score"],
        "factors": leased[0].payload["factors"],
        "tenant": "alice",  # the job's: its finalize step shares the fleet as its chunks do
    }
    assert store.client.zscore(store.keys.ready(MODEL_REF), finalize_id) == payload["score"]
    job = jobs.get_job(store, spec.job_id, now=NOW + 1)
    assert (job.chunks_done, job.rows_done, job.progress) == (3, 10, 1.0)


def test_the_ack_that_queues_the_finalize_item_rings_the_doorbell(store: Store) -> None:
    """Like every enqueue: a drain task lingering on the doorbell leases the finalize step at once.
    Acks that queue nothing (earlier chunks, a duplicate of the last) do not ring."""
    spec = job_spec(rows_total=10, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=3)

    rings = []
    for item in [*leased, leased[-1]]:
        ack(store, item, now=NOW + 1)
        rings.append(store.client.llen(store.keys.doorbell))

    assert rings == [0, 0, 1, 1]


def test_start_item_marks_a_queued_job_running_once(store: Store) -> None:
    spec = job_spec()
    job_fills.create_job(store, spec, now=NOW)
    key = [store.keys.job(spec.job_id), store.keys.job_counts]

    assert store.scripts.start_item(keys=key, args=[NOW + 1]) == "running"
    assert store.scripts.start_item(keys=key, args=[NOW + 2]) == "running"
    assert float(job_field(store, spec.job_id, "started_at")) == NOW + 1
    assert store.scripts.start_item(keys=[store.keys.job("jmissing"), store.keys.job_counts], args=[NOW]) == ""
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 3)
    assert store.scripts.start_item(keys=key, args=[NOW + 4]) == "cancelled"


def test_a_chunk_s_start_is_stamped_on_its_running_job_and_other_items_leave_it(store: Store) -> None:
    spec = job_spec()
    job_fills.create_job(store, spec, now=NOW)

    assert job_progress.start_item(store, spec.job_id, now=NOW + 1, chunk=True) == "running"
    assert float(job_field(store, spec.job_id, "chunk_started_at")) == NOW + 1
    assert job_progress.start_item(store, spec.job_id, now=NOW + 2) == "running"  # a commit's check, a merge
    assert float(job_field(store, spec.job_id, "chunk_started_at")) == NOW + 1
    assert job_progress.start_item(store, spec.job_id, now=NOW + 3, chunk=True) == "running"
    assert float(job_field(store, spec.job_id, "chunk_started_at")) == NOW + 3
    assert job_progress.start_item(store, spec.job_id, now=NOW + 2.5, chunk=True) == "running"  # a slot's late call
    assert float(job_field(store, spec.job_id, "chunk_started_at")) == NOW + 3
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 4)
    assert job_progress.start_item(store, spec.job_id, now=NOW + 5, chunk=True) == "cancelled"
    assert float(job_field(store, spec.job_id, "chunk_started_at")) == NOW + 3


# --- batch tickets --------------------------------------------------------------------------------


def test_stale_ticket_cannot_lease(store: Store) -> None:
    job_fills.create_job(store, job_spec(), now=NOW)

    with pytest.raises(StaleTicket):
        lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1, ticket="t99")

    assert len(ready_ids(store)) == 3  # nothing was leased


def test_live_ticket_leases_and_is_marked_seen(store: Store) -> None:
    job_fills.create_job(store, job_spec(), now=NOW)
    [ticket] = tickets.top_up_tickets(store, now=NOW, target=1)

    leased = lease_items(store, MODEL_REF, now=NOW + 7, lease_seconds=30, max_items=1, ticket=ticket)

    assert len(leased) == 1
    assert store.client.zscore(store.keys.tickets, ticket) == NOW + 7


def test_replaced_ticket_becomes_stale(store: Store) -> None:
    job_fills.create_job(store, job_spec(), now=NOW)
    [old] = tickets.top_up_tickets(store, now=NOW, target=1)
    assert tickets.expire_lost_tickets(store, now=NOW + 200, ticket_timeout=120) == 1
    [new] = tickets.top_up_tickets(store, now=NOW + 200, target=1)

    assert new != old
    assert store.client.zscore(store.keys.tickets, old) is None
    assert store.client.zscore(store.keys.tickets, new) == NOW + 200
    with pytest.raises(StaleTicket):
        lease_items(store, MODEL_REF, now=NOW + 201, lease_seconds=30, max_items=1, ticket=old)


def test_release_ticket_refuses_while_any_queue_has_waiting_work(store: Store) -> None:
    job_fills.create_job(store, job_spec("jidle", model_name="cnn", rows_total=1, chunk_size=1), now=NOW)
    lease_items(store, "cnn@v1", now=NOW, lease_seconds=30, max_items=1)  # cnn: only in-flight work
    job_fills.create_job(store, job_spec("jbusy", rows_total=2, chunk_size=1), now=NOW)
    [ticket] = tickets.top_up_tickets(store, now=NOW, target=1)

    assert tickets.release_ticket(store, ticket) is False
    assert tickets.ticket_count(store) == 1

    lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2)

    assert tickets.release_ticket(store, ticket) is True
    assert tickets.ticket_count(store) == 0


def test_release_ticket_with_no_queues_at_all_releases(store: Store) -> None:
    [ticket] = tickets.top_up_tickets(store, now=NOW, target=1)

    assert tickets.release_ticket(store, ticket) is True
    assert tickets.ticket_count(store) == 0


def test_top_up_creates_exactly_the_missing_tickets(store: Store) -> None:
    first = tickets.top_up_tickets(store, now=NOW, target=3)
    again = tickets.top_up_tickets(store, now=NOW, target=3)
    lower = tickets.top_up_tickets(store, now=NOW, target=1)
    more = tickets.top_up_tickets(store, now=NOW, target=5)

    assert len(first) == 3
    assert again == []
    assert lower == []  # never retires tickets
    assert len(more) == 2
    assert len(set(first + more)) == 5
    assert tickets.ticket_count(store) == 5


def test_expire_lost_tickets_drops_only_tickets_older_than_the_timeout(store: Store) -> None:
    job_fills.create_job(store, job_spec(), now=NOW)
    lost, alive = tickets.top_up_tickets(store, now=NOW, target=2)
    assert lease_items(store, MODEL_REF, now=NOW + 100, lease_seconds=30, max_items=1, ticket=alive)

    assert tickets.expire_lost_tickets(store, now=NOW + 119, ticket_timeout=120) == 0
    assert tickets.expire_lost_tickets(store, now=NOW + 130, ticket_timeout=120) == 1

    assert store.client.zrange(store.keys.tickets, 0, -1) == [alive]


def test_wake_workers_sends_one_drain_task_per_live_stream_slot(store: Store) -> None:
    workers.record_heartbeat(store, "gpu0", {"device": "cuda:0", "streams": 3}, now=NOW)
    workers.record_heartbeat(store, "gpu1", {"device": "cuda:1", "streams": 2}, now=NOW - 60)  # dead
    sent: list[str] = []

    count = wake_workers(store, sent.append, now=NOW, heartbeat_timeout=15)
    again = wake_workers(store, sent.append, now=NOW, heartbeat_timeout=15)

    assert (count, again) == (3, 0)
    assert len(set(sent)) == 3
    assert tickets.ticket_count(store) == 3


def test_wake_workers_keeps_one_ticket_when_no_worker_is_alive(store: Store) -> None:
    sent: list[str] = []

    assert wake_workers(store, sent.append, now=NOW, heartbeat_timeout=15) == 1
    assert len(sent) == 1


def test_a_payload_is_decoded_whether_orjson_takes_it_or_not() -> None:
    """Leases decode payloads with orjson; one it refuses (an infinity `json.dumps` wrote) still decodes."""
    assert leases.decode_payload('{"kind": "request", "rows": 2, "factors": {"level": 1}}') == {
        "kind": "request", "rows": 2, "factors": {"level": 1}}
    assert leases.decode_payload(json.dumps({"score": float("inf")})) == {"score": float("inf")}
    assert leases.decode_payload("") == {} and leases.decode_payload(None) == {}

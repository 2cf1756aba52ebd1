"""A job's items are queued, and taken out by a stop, in calls of `job_slices.ENQUEUE_SLICE` items, so that a
job of 100,000 chunks never holds Redis for seconds; a fill whose caller died part-way is completed by
the reaper, and a stop or resume between two calls of the other loses or duplicates nothing (real Redis;
the slice is made small so that a few chunks take several calls)."""

from __future__ import annotations

import json
import time

import pytest

from broker.errors import Conflict
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import slices as job_slices
from broker.jobs import stops as job_stops
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec, ready_ids
from tests.broker.sliced_calls import SLICE, chunk_ids, small_slices  # noqa: F401 (small_slices: autouse)
from tests.leasing import lease_items


def job_items(store: Store, job_id: str) -> list[str]:
    """Item ids of the job in the items hash (queued or leased)."""
    return sorted(item for item in store.client.hkeys(store.keys.items) if item.startswith(job_id))


def filling(store: Store) -> list[str]:
    return store.client.zrange(store.keys.jobs_filling, 0, -1)


def count_calls(store: Store, script: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the number of arguments of each call of `script` on this thread's store (the real script runs)."""
    registered = getattr(store.scripts, script)
    sizes: list[int] = []

    def counted(*, keys: list[str], args: list[object]) -> object:
        sizes.append(len(args))
        return registered(keys=keys, args=args)

    monkeypatch.setattr(store.scripts, script, counted)
    return sizes


def test_a_job_of_many_slices_is_queued_whole_in_several_calls_and_leaves_the_filling_index(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = job_spec("big", rows_total=10, chunk_size=1)  # 10 chunks: 4 calls of at most 3
    calls = count_calls(store, "enqueue_items", monkeypatch)

    job_fills.create_job(store, spec, now=NOW)

    assert calls == [8 + 4 * 3, 8 + 4 * 3, 8 + 4 * 3, 8 + 4 * 1]  # eight leading arguments, four an item
    assert sorted(ready_ids(store)) == sorted(chunk_ids("big", range(10)))
    assert filling(store) == [] and job_fills.stalled_fills(store, now=NOW + 3600) == []
    assert jobs.get_job(store, "big", now=NOW).chunks_total == 10
    with pytest.raises(Conflict):
        job_fills.create_job(store, spec, now=NOW)
    assert sorted(ready_ids(store)) == sorted(chunk_ids("big", range(10))) and filling(store) == []


def test_a_fill_going_on_is_not_taken_for_stalled_however_old_its_request_time(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's time is taken before its input is hashed (minutes, for a large file on slow storage):
    the filling index holds the time of each call instead."""
    registered = store.scripts.enqueue_items
    seen_stalled: list[list[str]] = []

    def enqueue_then_look(*, keys: list[str], args: list[object]) -> object:
        reply = registered(keys=keys, args=args)
        seen_stalled.append(job_fills.stalled_fills(store, now=time.time()))
        return reply

    monkeypatch.setattr(store.scripts, "enqueue_items", enqueue_then_look)
    job_fills.create_job(store, job_spec("slow", rows_total=7, chunk_size=1), now=time.time() - 3600)

    assert seen_stalled == [[], [], []]


def test_a_stop_takes_every_item_out_over_several_calls(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    job_fills.create_job(store, job_spec("big", rows_total=10, chunk_size=1), now=NOW)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2)  # two in flight
    calls = count_calls(store, "stop_job", monkeypatch)

    assert job_stops.stop_job(store, "big", status="cancelled", error="by the user", now=NOW + 1) == "cancelled"
    assert calls == [8 + 3, 8 + 3, 8 + 3, 8 + 2]  # ten chunks and the finalize item, eight leading arguments

    assert ready_ids(store) == [] and job_items(store, "big") == []
    assert store.client.zcard(store.keys.inflight(MODEL_REF)) == 0
    calls.clear()
    assert job_stops.stop_job(store, "big", status="cancelled", error="again", now=NOW + 2) == "cancelled"
    assert len(calls) == 1  # a second DELETE of a stop that finished walks nothing again
    assert jobs.get_job(store, "big", now=NOW).error == "by the user"
    assert "stop_done" not in jobs.get_job(store, "big", now=NOW).to_json()  # bookkeeping stays out of the API's view


def test_a_fill_whose_caller_died_is_completed_by_the_reaper_pass_once(store: Store) -> None:
    """As an API process killed after its first call leaves it: the job and chunks 0-2 queued, the rest not."""
    spec = job_spec("cut", rows_total=8, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    for item_id in chunk_ids("cut", range(3, 8)):  # undo the later calls
        store.client.zrem(store.keys.ready(MODEL_REF), item_id)
        store.client.hdel(store.keys.items, item_id)
    store.client.zadd(store.keys.jobs_filling, {"cut": NOW})
    [leased] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=300, max_items=1)  # a worker has one

    assert job_fills.stalled_fills(store, now=NOW + job_slices.FILL_STALLED_SECONDS - 1) == []  # its caller may be slow
    assert job_fills.stalled_fills(store, now=NOW + job_slices.FILL_STALLED_SECONDS) == ["cut"]
    assert job_fills.refill_job(store, "cut", now=NOW + 40) == 5

    assert sorted(ready_ids(store) + [leased.item_id]) == sorted(chunk_ids("cut", range(8)))  # each once
    assert filling(store) == [] and job_fills.refill_job(store, "cut", now=NOW + 41) == 0
    payload = json.loads(store.client.hget(store.keys.items, jobs.chunk_item_id("cut", 7)))
    assert (payload["start"], payload["stop"], payload["job"]) == (7, 8, "cut")


def test_a_fill_taken_up_after_its_job_was_stopped_adds_nothing(store: Store) -> None:
    job_fills.create_job(store, job_spec("gone", rows_total=8, chunk_size=1), now=NOW)
    job_stops.stop_job(store, "gone", status="cancelled", error="", now=NOW + 1)
    store.client.zadd(store.keys.jobs_filling, {"gone": NOW, "unknown": NOW})

    assert job_fills.refill_job(store, "gone", now=NOW + 40) == 0
    assert job_fills.refill_job(store, "unknown", now=NOW + 40) == 0
    assert ready_ids(store) == [] and filling(store) == []


def test_a_later_call_of_a_fill_adds_nothing_once_the_job_was_cancelled_meanwhile(store: Store) -> None:
    """The API queues a job while its owner cancels it: the cancel's calls may pass the fill's."""
    job_fills.create_job(store, job_spec("race", rows_total=4, chunk_size=1), now=NOW)
    job_stops.stop_job(store, "race", status="cancelled", error="", now=NOW + 1)
    keys = store.keys
    job_keys = [keys.ready(MODEL_REF), keys.items, keys.queues, keys.job("race"), keys.jobs, keys.job_done("race"),
                keys.inflight(MODEL_REF), keys.dead, keys.attempts, keys.jobs_filling, keys.job_counts,
                keys.queues_version, keys.job_cuts("race")]
    later = job_fills._item_args("race", MODEL_REF, jobs.chunk_ranges(4, 1), [3], 1.0, {}, 2, "", "")

    fill_id = store.client.hget(keys.job("race"), "fill_id")
    args = [MODEL_REF, "race", "{}", "add", NOW + 2, "more", NOW + 2, fill_id, *later]
    reply = store.scripts.enqueue_items(keys=job_keys, args=args)
    assert reply == -2
    assert ready_ids(store) == [] and filling(store) == []


def test_a_stop_s_later_calls_leave_what_a_resume_between_them_queued(store: Store) -> None:
    job_fills.create_job(store, job_spec("back", rows_total=6, chunk_size=1), now=NOW)
    keys = store.keys
    stop_keys = [keys.job("back"), keys.ready(MODEL_REF), keys.inflight(MODEL_REF), keys.items, keys.attempts,
                 keys.dead, keys.job_counts, keys.jobs_stopping, keys.counters, keys.latency_buckets, keys.jobs_due]
    first = store.scripts.stop_job(keys=stop_keys, args=["cancelled", "", NOW + 1, "", "first", "s1", "back", NOW + 1,
                                                         *chunk_ids("back", range(3))])
    assert first == "cancelled"

    job_fills.resume_job(store, "back", now=NOW + 2)  # chunks 0-2 queued again; 3-5 were never taken out
    rest = [*chunk_ids("back", range(3, 6)), jobs.finalize_item_id("back")]
    later = store.scripts.stop_job(keys=stop_keys, args=["cancelled", "", NOW + 3, "", "last", "s1", "back", NOW + 3,
                                                         *rest])

    assert later == "queued"
    assert store.client.zcard(keys.jobs_stopping) == 0
    assert sorted(ready_ids(store)) == sorted(chunk_ids("back", range(6)))
    assert jobs.get_job(store, "back", now=NOW).status == "queued"

"""A resume whose caller died between two of its enqueue calls is completed by a reaper pass in the mode
it began with (`job_fills.refill_job`): the earlier run's leased and dead chunks come back at once, each once
however many passes take it up (real Redis; the slice is made small so that a few chunks take several
calls; a caller's death is its script refusing every call after the first)."""

from __future__ import annotations

import pytest

from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import slices as job_slices
from broker.jobs import stops as job_stops
from broker.queueing import reaping
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, inflight_deadlines, job_spec, ready_ids
from tests.broker.sliced_calls import SLICE, before_first_call, chunk_ids, dying_after_first_call, small_slices  # noqa: F401 (small_slices: autouse)
from tests.leasing import lease_items


def crashed_run(store: Store, job_id: str) -> None:
    """A job of 10 chunks whose run died: chunks 0-8 still leased (for minutes yet), chunk 9 dead."""
    job_fills.create_job(store, job_spec(job_id, rows_total=10, chunk_size=1), now=NOW)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=300, max_items=9)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=1, max_items=1)
    result = reaping.reap_expired_leases(store, now=NOW + 2, max_attempts=1)
    assert [item_id for _, item_id, _ in result.dead_items] == [jobs.chunk_item_id(job_id, 9)]
    assert sorted(inflight_deadlines(store)) == chunk_ids(job_id, range(9)) and ready_ids(store) == []


def cut_resume(store: Store, job_id: str) -> None:
    """Resume `job_id` as an API process killed after the resume's first enqueue call leaves it."""
    with dying_after_first_call(store, "enqueue_items"):
        job_fills.resume_job(store, job_id, now=NOW + 10)
    assert sorted(ready_ids(store)) == chunk_ids(job_id, range(3))  # the first call took 0-2 back


def test_a_resume_cut_after_its_first_call_is_completed_in_resume_mode(store: Store) -> None:
    crashed_run(store, "run")
    cut_resume(store, "run")
    assert job_fills.stalled_fills(store, now=NOW + 10 + job_slices.FILL_STALLED_SECONDS + 3600) == ["run"]

    assert job_fills.refill_job(store, "run", now=NOW + 40) == 7

    assert sorted(ready_ids(store)) == chunk_ids("run", range(10))  # at once, not when their leases run out
    assert inflight_deadlines(store) == {} and store.client.zcard(store.keys.dead) == 0
    assert store.client.hmget(store.keys.attempts, chunk_ids("run", range(10))) == [None] * 10
    scores = {store.client.zscore(store.keys.ready(MODEL_REF), item) for item in ready_ids(store)}
    assert len(scores) == 1  # scored as the resume scored its first slice
    assert store.client.zcard(store.keys.jobs_filling) == 0
    assert not {"fill_mode", "filled_to", "fill_id"} & set(jobs.get_job(store, "run", now=NOW + 40).to_json())


def test_a_second_pass_takes_back_nothing_the_new_run_leased(store: Store) -> None:
    """Two reaper passes at once: the later one read the job while it was still filling."""
    crashed_run(store, "run")
    cut_resume(store, "run")
    assert job_fills.refill_job(store, "run", now=NOW + 40) == 7
    leased = lease_items(store, MODEL_REF, now=NOW + 41, lease_seconds=300, max_items=10)
    assert len(leased) == 10

    assert job_fills.refill_job(store, "run", now=NOW + 42) == 0

    assert ready_ids(store) == [] and sorted(inflight_deadlines(store)) == chunk_ids("run", range(10))
    assert store.client.hmget(store.keys.attempts, chunk_ids("run", range(10))) == ["1"] * 10


def test_a_stalled_stop_during_a_stalled_resume_is_completed_and_nothing_comes_back(store: Store) -> None:
    """The pass reads the resuming job; before its first call a cancel lands, and dies after its own first call."""
    crashed_run(store, "run")
    cut_resume(store, "run")

    def cancel_and_die() -> None:
        with dying_after_first_call(store, "stop_job"):
            job_stops.stop_job(store, "run", status="cancelled", error="by the user", now=NOW + 20)

    with before_first_call(store, "enqueue_items", cancel_and_die):
        assert job_fills.refill_job(store, "run", now=NOW + 40) == 0
    assert sorted(inflight_deadlines(store)) == chunk_ids("run", range(3, 9))  # what the cut cancel left
    assert job_stops.stalled_stops(store, now=NOW + 3600) == ["run"]

    assert job_stops.finish_stop(store, "run", now=NOW + 40) == "cancelled"

    assert ready_ids(store) == [] and inflight_deadlines(store) == {} and store.client.zcard(store.keys.dead) == 0
    assert [item for item in store.client.hkeys(store.keys.items) if item.startswith("run:")] == []
    assert store.client.zcard(store.keys.jobs_filling) == 0 and store.client.zcard(store.keys.jobs_stopping) == 0
    assert jobs.get_job(store, "run", now=NOW + 40).status == "cancelled"


def dead_ids(store: Store) -> list[str]:
    return sorted(store.client.zrange(store.keys.dead, 0, -1))


def test_a_fill_recorded_without_its_mode_is_completed_adding(store: Store) -> None:
    """A job hash written before fills recorded their mode or id: the earlier run's leases run out as before,
    and its dead chunk stays dead (the job fails by it) rather than also waiting in the ready queue."""
    crashed_run(store, "run")
    cut_resume(store, "run")
    store.client.hdel(store.keys.job("run"), "fill_mode", "filled_to", "fill_id")

    assert job_fills.refill_job(store, "run", now=NOW + 40) == 0  # chunks 3-8 leased, chunk 9 dead

    assert sorted(inflight_deadlines(store)) == chunk_ids("run", range(3, 9))
    assert sorted(ready_ids(store)) == chunk_ids("run", range(3))
    assert dead_ids(store) == [jobs.chunk_item_id("run", 9)]
    assert store.client.zcard(store.keys.jobs_filling) == 0


def test_a_resume_recorded_without_its_fill_id_is_completed_as_a_resume(store: Store) -> None:
    """A resume cut before fills had ids: its record ('' for an id) is its own, so a pass completes it."""
    crashed_run(store, "run")
    cut_resume(store, "run")
    store.client.hdel(store.keys.job("run"), "fill_id")

    assert job_fills.refill_job(store, "run", now=NOW + 40) == 7

    assert sorted(ready_ids(store)) == chunk_ids("run", range(10)) and dead_ids(store) == []
    assert inflight_deadlines(store) == {} and store.client.zcard(store.keys.jobs_filling) == 0


def test_a_pass_taking_up_an_older_fill_leaves_a_resume_begun_meanwhile_to_its_own_pass(store: Store) -> None:
    """A reaper pass reads the job's record of an adding fill; before its first call a resume begins, and its
    caller dies after that first call. The pass only adds what is missing (nothing: the rest is leased or
    dead), leaving the resume's record and filling entry, so that a later pass completes the resume."""
    crashed_run(store, "run")
    store.client.zadd(store.keys.jobs_filling, {"run": NOW})  # the pass took the job for stalled

    with before_first_call(store, "enqueue_items", lambda: cut_resume(store, "run")):
        assert job_fills.refill_job(store, "run", now=NOW + 40) == 0

    assert not set(ready_ids(store)) & set(dead_ids(store))
    assert dead_ids(store) == [jobs.chunk_item_id("run", 9)]
    assert sorted(inflight_deadlines(store)) == chunk_ids("run", range(3, 9))
    assert job_fills.stalled_fills(store, now=NOW + 10 + job_slices.FILL_STALLED_SECONDS) == ["run"]  # the resume's

    assert job_fills.refill_job(store, "run", now=NOW + 80) == 7

    assert sorted(ready_ids(store)) == chunk_ids("run", range(10))  # at once, not when their leases run out
    assert inflight_deadlines(store) == {} and dead_ids(store) == []
    assert store.client.zcard(store.keys.jobs_filling) == 0


def test_a_resume_of_one_call_after_a_cut_one_ends_it_and_a_stale_pass_takes_nothing_back(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second resume queues all the job lacks in one call; a pass that read the first one's record before
    it finds the new run's leases (its own record gone)."""
    crashed_run(store, "run")
    cut_resume(store, "run")
    monkeypatch.setattr(job_slices, "ENQUEUE_SLICE", 128)
    assert job_fills.resume_job(store, "run", now=NOW + 20) == 7
    monkeypatch.setattr(job_slices, "ENQUEUE_SLICE", SLICE)
    assert job_fills.stalled_fills(store, now=NOW + 3600) == []
    assert len(lease_items(store, MODEL_REF, now=NOW + 21, lease_seconds=300, max_items=10)) == 10

    assert job_fills.refill_job(store, "run", now=NOW + 40) == 0

    assert ready_ids(store) == [] and sorted(inflight_deadlines(store)) == chunk_ids("run", range(10))

"""A stop (cancel or fail) whose caller died between two of its calls is completed by a reaper pass
(`job_stops.stalled_stops`, `job_stops.finish_stop`), and stays right beside a resume, a second stop or another
pass (real Redis; the slice is made small so that a few chunks take several calls; a caller's death is
its script refusing every call after the first)."""

from __future__ import annotations

import time

import pytest

from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import slices as job_slices
from broker.jobs import stops as job_stops
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec, ready_ids
from tests.broker.sliced_calls import SLICE, before_first_call, dying_after_first_call, small_slices  # noqa: F401 (small_slices: autouse)
from tests.leasing import lease_items

OTHER_REF = "mlp@v2"


def job_items(store: Store, job_id: str) -> list[str]:
    """Item ids of the job anywhere: the items hash, ready, in flight or dead."""
    keys = store.keys
    found = set(store.client.hkeys(keys.items)) | set(store.client.zrange(keys.ready(MODEL_REF), 0, -1))
    found |= set(store.client.zrange(keys.inflight(MODEL_REF), 0, -1)) | set(store.client.zrange(keys.dead, 0, -1))
    return sorted(item for item in found if item.startswith(job_id + ":"))


def stopping(store: Store) -> list[str]:
    return store.client.zrange(store.keys.jobs_stopping, 0, -1)


def stalled_now() -> float:
    """A reaper's `now` at which a stop whose last call was just made counts as stalled."""
    return time.time() + job_slices.FILL_STALLED_SECONDS + 1


def cut_stop(store: Store, job_id: str, *, error: str = "by the user") -> None:
    """Cancel `job_id` as an API process killed after the stop's first call leaves it."""
    with dying_after_first_call(store, "stop_job"):
        job_stops.stop_job(store, job_id, status="cancelled", error=error, now=NOW + 1)


def test_a_stop_cut_after_its_first_call_is_completed_by_a_reaper_pass(store: Store) -> None:
    job_fills.create_job(store, job_spec("cut", rows_total=10, chunk_size=1), now=NOW)
    job_fills.create_job(store, job_spec("near", rows_total=4, chunk_size=1), now=NOW)  # same queue
    job_fills.create_job(store, job_spec("far", rows_total=4, chunk_size=1, model_version="v2"), now=NOW)
    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=300, max_items=2)
    assert [item.item_id for item in leased] == [jobs.chunk_item_id("cut", 0), jobs.chunk_item_id("cut", 1)]
    untouched = {name: job_items(store, name) for name in ("near", "far")}
    far_ready = ready_ids(store, OTHER_REF)

    cut_stop(store, "cut")

    left = job_items(store, "cut")
    assert left == sorted(jobs.chunk_item_id("cut", index) for index in range(3, 10))  # the first call's 0-2 gone
    assert stopping(store) == ["cut"]
    assert job_stops.stalled_stops(store, now=time.time()) == []  # its caller may only be slow
    assert job_stops.stalled_stops(store, now=stalled_now()) == ["cut"]

    assert job_stops.finish_stop(store, "cut", now=NOW + 40) == "cancelled"

    assert job_items(store, "cut") == [] and stopping(store) == []
    assert {name: job_items(store, name) for name in ("near", "far")} == untouched
    assert ready_ids(store, OTHER_REF) == far_ready
    assert sorted(ready_ids(store)) == untouched["near"]
    job = jobs.get_job(store, "cut", now=NOW + 40)
    assert (job.status, job.error, job.finished_at) == ("cancelled", "by the user", NOW + 1)
    assert "stop_id" not in job.to_json()
    assert store.client.hget(store.keys.job_counts, "cancelled") == "1"
    assert job_stops.finish_stop(store, "cut", now=NOW + 41) == "cancelled"  # a second pass changes nothing
    assert job_items(store, "cut") == [] and stopping(store) == []
    assert store.client.hget(store.keys.job_counts, "cancelled") == "1"


def test_a_resume_after_a_stalled_stop_keeps_every_item_it_queued(store: Store) -> None:
    job_fills.create_job(store, job_spec("back", rows_total=10, chunk_size=1), now=NOW)
    cut_stop(store, "back")

    assert job_fills.resume_job(store, "back", now=NOW + 2) == 3  # chunks 0-2; the stop never reached 3-9
    assert job_stops.stalled_stops(store, now=stalled_now()) == ["back"]
    assert job_stops.finish_stop(store, "back", now=NOW + 40) == "queued"

    assert sorted(ready_ids(store)) == [jobs.chunk_item_id("back", index) for index in range(10)]
    assert stopping(store) == [] and jobs.get_job(store, "back", now=NOW + 40).status == "queued"


def test_a_reaper_pass_that_read_the_stop_before_a_resume_takes_nothing_out(store: Store) -> None:
    """The pass reads the job (cancelled) and the resume lands before its first call."""
    job_fills.create_job(store, job_spec("back", rows_total=10, chunk_size=1), now=NOW)
    cut_stop(store, "back")

    with before_first_call(store, "stop_job", lambda: job_fills.resume_job(store, "back", now=NOW + 2)):
        assert job_stops.finish_stop(store, "back", now=NOW + 40) == "queued"

    assert sorted(ready_ids(store)) == [jobs.chunk_item_id("back", index) for index in range(10)]
    assert stopping(store) == []


def test_a_second_stop_takes_a_stalled_one_over_and_an_old_pass_leaves_it_alone(store: Store) -> None:
    """A second DELETE finishes a stalled stop at once; if it dies part-way too, a pass that still carries
    the first stop's id leaves the second one's record, so that a later pass completes it."""
    job_fills.create_job(store, job_spec("twice", rows_total=10, chunk_size=1), now=NOW)
    cut_stop(store, "twice")
    first_stop_id = store.client.hget(store.keys.job("twice"), "stop_id")
    with dying_after_first_call(store, "stop_job"):  # the second DELETE takes it over, then dies too
        assert job_stops.stop_job(store, "twice", status="cancelled", error="again", now=NOW + 3) == "cancelled"

    reply = job_stops._take_items_out(store, "twice", MODEL_REF, [jobs.chunk_item_id("twice", 9)], status="cancelled",
                                 error="", now=NOW + 40, stop_id=first_stop_id, continued=True)
    assert reply == "superseded"
    assert jobs.chunk_item_id("twice", 9) in job_items(store, "twice")  # the old stop's call took nothing out
    assert stopping(store) == ["twice"]  # the second stop's record stays

    assert job_stops.finish_stop(store, "twice", now=NOW + 41) == "cancelled"
    assert job_items(store, "twice") == [] and stopping(store) == []
    assert jobs.get_job(store, "twice", now=NOW + 41).error == "by the user"  # the first stop's reason stays


def test_a_second_stop_finishes_a_stalled_one_at_once(store: Store) -> None:
    job_fills.create_job(store, job_spec("twice", rows_total=10, chunk_size=1), now=NOW)
    cut_stop(store, "twice")

    assert job_stops.stop_job(store, "twice", status="cancelled", error="again", now=NOW + 3) == "cancelled"
    assert job_items(store, "twice") == [] and stopping(store) == []


def test_two_reaper_passes_at_once_complete_a_stop_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other pass runs all of its calls just before this one's first: this one's calls take out nothing
    more, and do not record again the stop the other completed."""
    job_fills.create_job(store, job_spec("cut", rows_total=10, chunk_size=1), now=NOW)
    job_fills.create_job(store, job_spec("near", rows_total=4, chunk_size=1), now=NOW)
    cut_stop(store, "cut")
    registered = store.scripts.stop_job
    recorded_after: list[list[str]] = []  # the stopping index after each call, the other pass's first

    def call_and_look(*, keys: list[str], args: list[object]) -> object:
        reply = registered(keys=keys, args=args)
        recorded_after.append(stopping(store))
        return reply

    monkeypatch.setattr(store.scripts, "stop_job", call_and_look)
    with before_first_call(store, "stop_job", lambda: job_stops.finish_stop(store, "cut", now=NOW + 40)):
        assert job_stops.finish_stop(store, "cut", now=NOW + 40) == "cancelled"

    assert recorded_after == [["cut"]] * 3 + [[]] + [[]] * 4  # four calls of each (ten chunks, the finalize item)
    assert job_items(store, "cut") == [] and stopping(store) == []
    assert sorted(ready_ids(store)) == [jobs.chunk_item_id("near", index) for index in range(4)]
    assert store.client.hget(store.keys.job_counts, "cancelled") == "1"


def test_a_stop_recorded_without_a_stop_id_is_completed(store: Store) -> None:
    """A job hash written before stops recorded their id."""
    job_fills.create_job(store, job_spec("old", rows_total=10, chunk_size=1), now=NOW)
    cut_stop(store, "old")
    store.client.hdel(store.keys.job("old"), "stop_id")

    assert job_stops.finish_stop(store, "old", now=NOW + 40) == "cancelled"
    assert job_items(store, "old") == [] and stopping(store) == []


def test_a_stalled_stop_of_a_job_gone_or_finished_only_leaves_the_index(store: Store) -> None:
    job_fills.create_job(store, job_spec("done", rows_total=10, chunk_size=1), now=NOW)
    cut_stop(store, "done")
    store.client.hset(store.keys.job("done"), "status", "succeeded")  # its merge published meanwhile
    store.client.zadd(store.keys.jobs_stopping, {"unknown": NOW})

    assert job_stops.finish_stop(store, "done", now=NOW + 40) == "succeeded"
    assert job_stops.finish_stop(store, "unknown", now=NOW + 40) == ""
    assert stopping(store) == []

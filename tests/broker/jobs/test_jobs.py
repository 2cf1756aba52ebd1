"""Jobs: the hash that is their checkpoint, their chunk items, cancel and resume."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.errors import Conflict, JobNotFound
from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import output_dirs
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.queueing import leases, reaping
from broker.queueing.scoring import Weights, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, ack, inflight_deadlines, job_field, job_spec, ready_ids
from tests.leasing import lease_items


def finish_job(store: Store, job_id: str, *, now: float) -> None:
    """Run every chunk and then the finalize item, as a worker would."""
    for item in lease_items(store, MODEL_REF, now=now, lease_seconds=30, max_items=1000):
        if item.payload["kind"] == "chunk":
            ack(store, item, now=now)
    [final] = lease_items(store, MODEL_REF, now=now, lease_seconds=30, max_items=1000)
    assert final.payload["kind"] == "finalize"
    leases.finish_item(
        store, final, job_id, now=now, job_status="succeeded", job_fields={"manifest": json.dumps({"rows": 1})}
    )


# --- creating ---------------------------------------------------------------------------------


def test_create_job_writes_the_checkpoint_fields(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4, priority=2)

    job_fills.create_job(store, spec, now=NOW)

    raw = store.client.hgetall(store.keys.job(spec.job_id))
    assert raw["status"] == "queued"
    assert raw["rows_total"] == "10"
    assert raw["chunks_total"] == "3"
    assert raw["rows_done"] == raw["chunks_done"] == raw["chunk_runs"] == "0"
    assert raw["input_checksum"] == "sha256:0123abcd"
    assert raw["model_version"] == "v1"
    assert raw["model_ref"] == MODEL_REF
    assert raw["output_dir"] == "/data/out"
    assert float(raw["checkpoint_ts"]) == NOW
    assert float(raw["created_at"]) == NOW
    job = jobs.get_job(store, spec.job_id, now=NOW)
    assert job.output_names == ["logits"]
    assert job.priority == 2
    assert job.progress == 0.0
    assert job.error is None
    assert job.eta_seconds is None
    assert job_progress.done_chunks(store, spec.job_id) == set()


def test_create_job_queues_one_item_per_chunk(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4, priority=2)

    job_fills.create_job(store, spec, now=NOW)

    ids = [jobs.chunk_item_id(spec.job_id, i) for i in range(3)]
    assert ready_ids(store) == ids
    payloads = [json.loads(store.client.hget(store.keys.items, item_id)) for item_id in ids]
    assert [(p["chunk"], p["start"], p["stop"]) for p in payloads] == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    assert {p["score"] for p in payloads} == {queue_key(jobs.job_factors(2, NOW), Weights())}
    assert store.client.smembers(store.keys.queues) == {MODEL_REF}
    assert store.client.zscore(store.keys.jobs, spec.job_id) == NOW


def test_creating_an_existing_job_is_a_conflict(store: Store) -> None:
    spec = job_spec()
    job_fills.create_job(store, spec, now=NOW)

    with pytest.raises(Conflict, match=spec.job_id):
        job_fills.create_job(store, spec, now=NOW + 1)

    assert len(ready_ids(store)) == 3  # nothing queued twice


def test_chunk_ranges_of_an_exact_multiple_and_a_remainder() -> None:
    assert jobs.chunk_ranges(8, 4) == [(0, 4), (4, 8)]
    assert jobs.chunk_ranges(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert jobs.chunk_ranges(3, 10) == [(0, 3)]


@given(rows_total=st.integers(1, 5000), chunk_size=st.integers(1, 700))
def test_chunk_ranges_tile_all_rows_in_order(rows_total: int, chunk_size: int) -> None:
    ranges = jobs.chunk_ranges(rows_total, chunk_size)

    assert ranges[0][0] == 0
    assert ranges[-1][1] == rows_total
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(ranges, ranges[1:], strict=False))
    assert all(0 < stop - start <= chunk_size for start, stop in ranges)
    assert len(ranges) == -(-rows_total // chunk_size)


def test_chunk_item_ids_sort_in_chunk_order() -> None:
    ids = [jobs.chunk_item_id("j1", i) for i in (0, 2, 10, 9999, 123456)]

    assert sorted(ids) == ids


# --- reading ------------------------------------------------------------------------------------


def test_get_job_on_an_unknown_id_raises_job_not_found(store: Store) -> None:
    with pytest.raises(JobNotFound, match="jnothere"):
        jobs.get_job(store, "jnothere", now=NOW)


def started_with_a_chunk_done(store: Store, rows_total: int) -> jobs.JobSpec:
    """A job of 4-row chunks started at NOW whose first chunk was acked 2 s later."""
    spec = job_spec(rows_total=rows_total, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)
    job_progress.start_item(store, spec.job_id, now=NOW)
    ack(store, item, now=NOW + 2)
    return spec


def test_get_job_derives_rate_and_eta_from_progress(store: Store) -> None:
    spec = started_with_a_chunk_done(store, rows_total=8)

    job = jobs.get_job(store, spec.job_id, now=NOW + 2)

    assert job.progress == 0.5
    assert job.rows_per_second == 2.0
    assert job.eta_seconds == 2.0


def test_after_a_resume_rate_and_eta_are_of_the_resumed_run_not_of_the_time_stopped(store: Store) -> None:
    spec = started_with_a_chunk_done(store, rows_total=12)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 2)
    job_fills.resume_job(store, spec.job_id, now=NOW + 100)  # stood stopped for 98 s
    [second] = lease_items(store, MODEL_REF, now=NOW + 100, lease_seconds=30, max_items=1)
    ack(store, second, now=NOW + 101)

    job = jobs.get_job(store, spec.job_id, now=NOW + 101)

    assert (job.rows_done, job.rows_per_second, job.eta_seconds) == (8, 4.0, 1.0)  # 4 rows in 1 s
    assert (job.elapsed_seconds, job.resumed_at) == (101.0, NOW + 100)  # since its first start
    assert "rows_at_resume" not in job.to_json()


def test_list_jobs_is_newest_first_and_filters_by_status(store: Store) -> None:
    for i, job_id in enumerate(["jold", "jmid", "jnew"]):
        job_fills.create_job(store, job_spec(job_id, rows_total=1, chunk_size=1), now=NOW + i)
    job_stops.stop_job(store, "jmid", status="cancelled", error="", now=NOW + 10)

    assert [job.id for job in job_lists.list_jobs(store, now=NOW + 10)] == ["jnew", "jmid", "jold"]
    assert [job.id for job in job_lists.list_jobs(store, now=NOW + 10, limit=2)] == ["jnew", "jmid"]
    assert [job.id for job in job_lists.list_jobs(store, now=NOW + 10, status="queued")] == ["jnew", "jold"]
    assert [job.id for job in job_lists.list_jobs(store, now=NOW + 10, status="queued", limit=1)] == ["jnew"]
    assert [job.id for job in job_lists.list_jobs(store, now=NOW + 10, status="cancelled")] == ["jmid"]
    assert job_lists.list_jobs(store, now=NOW + 10, status="failed") == []
    assert job_lists.count_jobs_by_status(store) == {"queued": 2, "cancelled": 1}


@pytest.mark.parametrize("indexed", [True, False], ids=["owner-index", "scan-before-the-index-is-built"])
def test_list_jobs_by_owner_is_that_owner_s_newest_across_index_pages(
        store: Store, monkeypatch: pytest.MonkeyPatch, indexed: bool) -> None:
    monkeypatch.setattr(job_lists, "LIST_SCAN_PAGE", 2)  # the owner's jobs lie several pages down the index
    owners = ["bob", "alice", "bob", "bob", "alice", "bob", "bob", ""]
    for i, owner in enumerate(owners):
        spec = dataclasses.replace(job_spec(f"j{i}", rows_total=1, chunk_size=1), owner=owner)
        job_fills.create_job(store, spec, now=NOW + i)
    job_stops.stop_job(store, "j4", status="cancelled", error="", now=NOW + 10)
    if indexed:
        assert job_lists.index_job_owners(store)  # as a reaper pass does

    def listed(**filters: Any) -> list[str]:  # (an owner's jobs within their tenant: the key's name, given none)
        filters.setdefault("tenant", filters.get("owner"))
        return [job.id for job in job_lists.list_jobs(store, now=NOW + 10, **filters)]

    assert listed(owner="alice") == ["j4", "j1"]
    assert listed(owner="alice", limit=1) == ["j4"]
    assert listed(owner="alice", status="queued") == ["j1"]
    assert listed(owner="carol") == []
    assert listed(limit=1) == ["j7"]  # no filter: every job, the ownerless one included
    assert jobs.get_job(store, "j7", now=NOW).owner is None
    assert jobs.get_job(store, "j1", now=NOW).owner == "alice"
    monkeypatch.setattr(job_lists, "LIST_SCAN_JOBS", 3)  # a scan looks through the newest 3 jobs only
    assert listed(status="queued") == ["j7", "j6", "j5"]
    assert listed(owner="bob", status="queued") == (["j6", "j5", "j3"] if indexed else ["j6", "j5"])
    assert listed(owner="alice") == (["j4", "j1"] if indexed else [])  # the index holds its jobs alone


def test_reaper_passes_index_jobs_stored_before_the_owner_indexes_a_page_at_a_time(store: Store) -> None:
    """Jobs written by a release without per-owner indexes (or by an older API process during an upgrade)."""
    owners = ["alice", "bob", "alice", "", "alice"]
    for i, owner in enumerate(owners):
        spec = dataclasses.replace(job_spec(f"j{i}", rows_total=1, chunk_size=1), owner=owner)
        job_fills.create_job(store, spec, now=NOW + (i if i < 3 else 2))  # j2, j3 and j4 share a creation time
    store.client.delete(store.keys.owner_jobs("alice", "alice"), store.keys.owner_jobs("bob", "bob"))

    assert not job_lists.index_job_owners(store, limit=4)  # a full page: more may follow
    assert not store.client.exists(store.keys.owner_index_built)
    scanned = job_lists.list_jobs(store, now=NOW + 10, owner="alice", tenant="alice")
    assert [job.id for job in scanned] == ["j4", "j2", "j0"]  # scan
    assert job_lists.index_job_owners(store, limit=4)  # the rest, from the job after the last one indexed
    assert store.client.zrange(store.keys.owner_jobs("alice", "alice"), 0, -1, withscores=True) == [
        ("j0", NOW), ("j2", NOW + 2), ("j4", NOW + 2)]
    assert store.client.zrange(store.keys.owner_jobs("bob", "bob"), 0, -1) == ["j1"]
    job_fills.create_job(store, dataclasses.replace(job_spec("j5", rows_total=1, chunk_size=1), owner="bob"),
                    now=NOW + 5)
    store.client.zrem(store.keys.owner_jobs("bob", "bob"), "j5")  # as an older API process wrote it
    assert job_lists.index_job_owners(store)
    assert [job.id for job in job_lists.list_jobs(store, now=NOW + 10, owner="bob", tenant="bob")] == ["j5", "j1"]


# --- output folders -------------------------------------------------------------------------------

ALICE, ALICE_2ND_KEY = {"name": "alice", "role": "user"}, {"name": "alice", "role": "user"}
BOB, ADMIN = {"name": "bob", "role": "user"}, {"name": "ops", "role": "admin"}


def held_by(store: Store, owner: str, status: str) -> str:
    """A job of `owner` in `status` that holds /data/out; returns its id."""
    spec = dataclasses.replace(job_spec(rows_total=4, chunk_size=4), owner=owner)
    output_dirs.claim_output_dir(store, spec.output_dir, spec.job_id, caller={"name": owner, "role": "user"})
    job_fills.create_job(store, spec, now=NOW)
    if status != "queued":
        store.client.hset(store.keys.job(spec.job_id), "status", status)
    return spec.job_id


@pytest.mark.parametrize("status", ["cancelled", "failed", "succeeded"])
def test_a_stopped_job_s_folder_is_taken_only_by_keys_that_own_the_job(store: Store, status: str) -> None:
    """Its parts are its resumable work: another tenant's job finishing there would block the resume."""
    holder = held_by(store, "alice", status)

    with pytest.raises(Conflict) as refused:
        output_dirs.claim_output_dir(store, "/data/out", "jbob", caller=BOB)
    assert refused.value.message == ("output_dir /data/out was last used by another tenant's job, whose parts "
                                     "or results may still be there; choose another folder")
    assert output_dirs.holds_output_dir(store, "/data/out", holder)
    for caller in (ALICE_2ND_KEY, ADMIN):  # the same tenant (any of its keys), and admins
        output_dirs.claim_output_dir(store, "/data/out", f"j-{caller['role']}", caller=caller)
        assert output_dirs.holds_output_dir(store, "/data/out", f"j-{caller['role']}")


def test_an_active_job_s_folder_is_taken_by_no_one_and_a_gone_job_s_by_anyone(store: Store) -> None:
    holder = held_by(store, "alice", "running")
    for caller in (ALICE, BOB, ADMIN):
        with pytest.raises(Conflict, match="is in use by"):
            output_dirs.claim_output_dir(store, "/data/out", "jnew", caller=caller)

    store.client.delete(store.keys.job(holder))  # gone from Redis: nothing of it to protect
    output_dirs.claim_output_dir(store, "/data/out", "jbob", caller=BOB)
    assert output_dirs.holds_output_dir(store, "/data/out", "jbob")


def test_a_folder_of_a_job_stored_without_an_owner_is_an_admin_s_to_take(store: Store) -> None:
    held_by(store, "", "cancelled")

    with pytest.raises(Conflict, match="last used by another tenant's job"):
        output_dirs.claim_output_dir(store, "/data/out", "jalice", caller=ALICE)
    output_dirs.claim_output_dir(store, "/data/out", "jadmin", caller=ADMIN)


# --- cancel ---------------------------------------------------------------------------------------


def test_cancel_removes_waiting_and_leased_items(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4)
    other = job_spec("jother", rows_total=1, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    job_fills.create_job(store, other, now=NOW + 1)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)

    status = job_stops.stop_job(store, spec.job_id, status="cancelled", error="cancelled by the user", now=NOW + 2)

    assert status == "cancelled"
    assert ready_ids(store) == ["jother:c0000000"]  # other jobs keep their items
    assert inflight_deadlines(store) == {}
    assert store.client.hkeys(store.keys.items) == ["jother:c0000000"]
    assert store.client.hlen(store.keys.attempts) == 0
    job = jobs.get_job(store, spec.job_id, now=NOW + 2)
    assert (job.status, job.error, job.finished_at) == ("cancelled", "cancelled by the user", NOW + 2)


def test_ack_after_cancel_is_ignored(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    [item] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 1)

    assert ack(store, item, now=NOW + 2) == 0

    job = jobs.get_job(store, spec.job_id, now=NOW + 2)
    assert job.status == "cancelled"
    assert (job.chunks_done, job.rows_done) == (0, 0)
    assert job_progress.done_chunks(store, spec.job_id) == set()
    assert ready_ids(store) == []


def test_stopping_a_finished_job_keeps_its_status(store: Store) -> None:
    spec = job_spec(rows_total=2, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    finish_job(store, spec.job_id, now=NOW + 1)

    assert job_stops.stop_job(store, spec.job_id, status="cancelled", error="", now=NOW + 2) == "succeeded"
    assert job_field(store, spec.job_id, "status") == "succeeded"


def test_stopping_an_unknown_job_raises_job_not_found(store: Store) -> None:
    with pytest.raises(JobNotFound):
        job_stops.stop_job(store, "jghost", status="cancelled", error="", now=NOW)


# --- resume ------------------------------------------------------------------------------------


def test_resume_re_queues_exactly_the_chunks_not_done(store: Store) -> None:
    spec = job_spec(rows_total=10, chunk_size=2)  # 5 chunks
    job_fills.create_job(store, spec, now=NOW)
    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=5)
    ack(store, leased[0], now=NOW + 1)
    ack(store, leased[3], now=NOW + 1)
    # everything crashes: the other three leases are held by workers that are gone

    added = job_fills.resume_job(store, spec.job_id, now=NOW + 5)

    assert added == 3
    assert ready_ids(store) == [jobs.chunk_item_id(spec.job_id, i) for i in (1, 2, 4)]
    assert inflight_deadlines(store) == {}  # leased chunks were taken back
    resumed = json.loads(store.client.hget(store.keys.items, jobs.chunk_item_id(spec.job_id, 4)))
    expected_score = queue_key(jobs.job_factors(0, NOW + 5), Weights())
    assert (resumed["start"], resumed["stop"], resumed["score"]) == (8, 10, expected_score)
    job = jobs.get_job(store, spec.job_id, now=NOW + 5)
    assert (job.status, job.chunks_done, job.rows_done) == ("queued", 2, 4)


def test_resume_of_a_cancelled_job_re_queues_its_missing_chunks(store: Store) -> None:
    spec = job_spec(rows_total=6, chunk_size=2)
    job_fills.create_job(store, spec, now=NOW)
    [first] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)
    ack(store, first, now=NOW + 1)
    job_stops.stop_job(store, spec.job_id, status="cancelled", error="cancelled by the user", now=NOW + 2)

    assert job_fills.resume_job(store, spec.job_id, now=NOW + 3) == 2

    assert ready_ids(store) == [jobs.chunk_item_id(spec.job_id, i) for i in (1, 2)]
    job = jobs.get_job(store, spec.job_id, now=NOW + 3)
    assert (job.status, job.error, job.finished_at) == ("queued", None, None)


def test_resume_does_not_duplicate_chunks_already_waiting(store: Store) -> None:
    spec = job_spec(rows_total=6, chunk_size=2)
    job_fills.create_job(store, spec, now=NOW)

    assert job_fills.resume_job(store, spec.job_id, now=NOW + 1) == 0

    assert len(ready_ids(store)) == 3


def test_late_ack_from_a_pre_resume_lease_is_counted_once(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=2)
    job_fills.create_job(store, spec, now=NOW)
    [old, _] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2)
    job_fills.resume_job(store, spec.job_id, now=NOW + 1)
    [new, _] = lease_items(store, MODEL_REF, now=NOW + 2, lease_seconds=30, max_items=2)

    assert [ack(store, old, now=NOW + 3), ack(store, new, now=NOW + 4)] == [1, 0]

    assert job_progress.done_chunks(store, spec.job_id) == {0}
    assert job_field(store, spec.job_id, "chunks_done") == "1"


def test_resume_with_every_chunk_done_queues_only_the_finalize_step(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=2)
    job_fills.create_job(store, spec, now=NOW)
    for item in lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2):
        ack(store, item, now=NOW + 1)
    job_stops.stop_job(store, spec.job_id, status="failed", error="finalize crashed", now=NOW + 2)
    assert ready_ids(store) == []  # stop took the finalize item out too

    assert job_fills.resume_job(store, spec.job_id, now=NOW + 3) == 1

    finalize_id = jobs.finalize_item_id(spec.job_id)
    assert ready_ids(store) == [finalize_id]
    assert json.loads(store.client.hget(store.keys.items, finalize_id))["kind"] == "finalize"


def test_resume_of_a_succeeded_job_is_a_conflict(store: Store) -> None:
    spec = job_spec(rows_total=2, chunk_size=1)
    job_fills.create_job(store, spec, now=NOW)
    finish_job(store, spec.job_id, now=NOW + 1)
    assert jobs.get_job(store, spec.job_id, now=NOW + 1).manifest == {"rows": 1}

    with pytest.raises(Conflict, match="already succeeded"):
        job_fills.resume_job(store, spec.job_id, now=NOW + 2)

    assert ready_ids(store) == []


def test_resume_of_an_unknown_job_raises_job_not_found(store: Store) -> None:
    with pytest.raises(JobNotFound):
        job_fills.resume_job(store, "jghost", now=NOW)


def test_a_resume_between_reap_and_fail_wins_over_the_reaper(store: Store) -> None:
    spec = job_spec(rows_total=4, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    for attempt in range(3):
        lease_items(store, MODEL_REF, now=NOW + attempt * 10, lease_seconds=1, max_items=1)
        result = reaping.reap_expired_leases(store, now=NOW + attempt * 10 + 5, max_attempts=3)
    (_, dead_item, _), = result.dead_items

    job_fills.resume_job(store, spec.job_id, now=NOW + 40)  # the user resumes before the reaper fails the job
    outcome = job_stops.stop_job(store, spec.job_id, status="failed", error="x", now=NOW + 41, dead_item=dead_item)

    assert outcome == "skipped"
    assert job_field(store, spec.job_id, "status") == "queued"
    assert ready_ids(store) == [dead_item]
    assert store.client.hget(store.keys.attempts, dead_item) is None  # fresh attempts after a resume


def test_the_reaper_fails_a_job_whose_item_stays_dead(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    lease_items(store, MODEL_REF, now=NOW, lease_seconds=1, max_items=1)
    (_, dead_item, _), = reaping.reap_expired_leases(store, now=NOW + 5, max_attempts=1).dead_items

    outcome = job_stops.stop_job(store, spec.job_id, status="failed", error="poison", now=NOW + 6, dead_item=dead_item)

    assert outcome == "failed"
    assert ready_ids(store) == [] and store.client.zcard(store.keys.dead) == 0
    assert store.client.hlen(store.keys.items) == 0


def test_chunk_item_ids_are_told_from_finalize_and_request_ids() -> None:
    job_id = jobs.new_job_id()
    assert jobs.is_chunk_item_id(jobs.chunk_item_id(job_id, 12))
    assert not jobs.is_chunk_item_id(jobs.finalize_item_id(job_id))
    assert not jobs.is_chunk_item_id("r0123abcd") and not jobs.is_chunk_item_id(":c1")
    assert jobs.chunk_job_id(jobs.chunk_item_id(job_id, 12)) == job_id
    assert jobs.chunk_job_id(jobs.finalize_item_id(job_id)) is None

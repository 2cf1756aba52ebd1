"""Chunks split as they run (`broker.jobs.cuts`, `split_chunk.lua`, `granularity.split_row`): the rest of a
running chunk becomes a new chunk of its job, queued, in one atomic step; everything that reads a job's chunks
then sees them as they are."""

from __future__ import annotations

import dataclasses
import json

from broker.jobs import cuts
from broker.jobs import fills as job_fills
from broker.jobs import stops as job_stops
from broker.jobs.granularity import split_row
from broker.jobs.records import get_job
from broker.queueing import leases
from broker.queueing.leases import LeaseOptions
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, ack, job_spec, ready_ids
from tests.broker.sliced_calls import before_first_call


def test_a_chunk_on_plan_runs_on_and_one_far_past_it_ends_at_its_boundary() -> None:
    plan = {"start": 0, "stop": 1_000, "chunk_seconds": 1.0, "batch_rows": 10}
    assert split_row(next_row=500, elapsed=0.5, **plan) is None  # not yet a chunk's time
    assert split_row(next_row=600, elapsed=1.0, **plan) is None  # the whole in 1.7 s: within twice
    assert split_row(next_row=300, elapsed=1.0, **plan) == 300  # the whole in 3.3 s
    assert split_row(next_row=995, elapsed=5.0, **plan) is None  # less than a mini-batch left


def create(store: Store, job_id: str = "jbig", *, rows: int = 100, chunk: int = 50) -> None:
    job_fills.create_job(store, dataclasses.replace(job_spec(job_id, rows_total=rows, chunk_size=chunk),
                                                    tenant="acme"), now=NOW)


def lease_one(store: Store) -> leases.LeasedItem:
    [item] = leases.lease_batch(store, MODEL_REF, LeaseOptions(max_items=8, max_chunks=1), now=NOW + 1,
                                lease_seconds=30).items
    return item


def test_a_split_shortens_the_chunk_and_queues_its_rest_as_a_new_chunk(store: Store) -> None:
    create(store)
    item = lease_one(store)  # chunk 0: rows [0, 50)

    done = cuts.split_chunk(store, item, row=20)

    assert done == cuts.Split(split=True, stop=20, new_index=2) and item.payload["stop"] == 20
    stored = json.loads(store.client.hget(store.keys.items, item.item_id))
    assert (stored["start"], stored["stop"]) == (0, 20)  # a re-lease after a crash runs only its rows
    rest = json.loads(store.client.hget(store.keys.items, "jbig:c0000002"))
    assert (rest["chunk"], rest["start"], rest["stop"], rest["tenant"]) == (2, 20, 50, "acme")
    assert "jbig:c0000002" in ready_ids(store)
    job = get_job(store, "jbig", now=NOW)
    assert job.chunks_total == 3
    assert cuts.chunk_layout(store, "jbig", rows_total=100, chunk_size=50, chunks_total=3) == [(0, 20), (50, 100),
                                                                                               (20, 50)]


def test_the_last_ack_of_a_split_job_queues_its_finalize_step_only_when_every_chunk_is_done(store: Store) -> None:
    create(store, rows=60, chunk=30)
    first = lease_one(store)
    cuts.split_chunk(store, first, row=10)
    assert ack(store, first, now=NOW + 2) == 1  # recorded
    taken = [lease_one(store), lease_one(store)]
    assert sorted((item.payload["start"], item.payload["stop"]) for item in taken) == [(10, 30), (30, 60)]
    assert [ack(store, item, now=NOW + 3) for item in taken] == [1, 2]  # the last one queues the finalize step
    assert get_job(store, "jbig", now=NOW).rows_done == 60


def test_a_split_is_refused_to_a_stale_run_and_to_a_stopped_job(store: Store) -> None:
    create(store)
    item = lease_one(store)
    stale = dataclasses.replace(item, payload=dict(item.payload))
    assert cuts.split_chunk(store, item, row=30).split
    # the same chunk run twice (its lease was reaped): the other run ends where the first split it
    assert cuts.split_chunk(store, stale, row=40) == cuts.Split(split=False, stop=30)
    assert get_job(store, "jbig", now=NOW).chunks_total == 3

    job_stops.stop_job(store, "jbig", status="cancelled", error="", now=NOW + 2)
    assert not cuts.split_chunk(store, item, row=10).split
    assert get_job(store, "jbig", now=NOW).chunks_total == 3


def test_a_chunk_not_leased_is_never_split(store: Store) -> None:
    create(store)
    item = lease_one(store)
    leases.return_unrun(store, [item])
    assert cuts.split_chunk(store, item, row=10) == cuts.Split(split=False, stop=50)


def test_a_resume_queues_the_chunks_as_they_were_split(store: Store) -> None:
    create(store)
    item = lease_one(store)
    cuts.split_chunk(store, item, row=20)
    ack(store, item, now=NOW + 2)
    job_stops.stop_job(store, "jbig", status="cancelled", error="", now=NOW + 3)

    job_fills.resume_job(store, "jbig", now=NOW + 4)

    waiting = {json.loads(store.client.hget(store.keys.items, item_id))["chunk"]:
               tuple(json.loads(store.client.hget(store.keys.items, item_id))[key] for key in ("start", "stop"))
               for item_id in ready_ids(store)}
    assert waiting == {1: (50, 100), 2: (20, 50)}


def test_stored_stop_reads_a_split_and_the_chunk_size_otherwise(store: Store) -> None:
    create(store, rows=90, chunk=40)
    item = lease_one(store)
    cuts.split_chunk(store, item, row=25)
    assert cuts.stored_stop(store, "jbig", 0, rows_total=90, chunk_size=40) == 25
    assert cuts.stored_stop(store, "jbig", 3, rows_total=90, chunk_size=40) == 40  # the new chunk: [25, 40)
    assert cuts.stored_stop(store, "jbig", 2, rows_total=90, chunk_size=40) == 90


def test_a_resume_that_read_the_chunks_before_a_split_queues_them_as_split(store: Store) -> None:
    """A resume of a running job reads its chunks, a worker splits one, then the resume's call takes it back:
    the chunk is queued with its range as split, so no two chunks ever cover the same rows."""
    create(store)
    item = lease_one(store)
    stale = job_fills._item_args("jbig", MODEL_REF, [(0, 50), (50, 100)], [0, 1], 1.0, {}, 10, "acme", "")
    assert cuts.split_chunk(store, item, row=20).split

    job_fills._enqueue(store, "jbig", MODEL_REF, {}, "resume", NOW + 2, stale)

    stored = json.loads(store.client.hget(store.keys.items, item.item_id))
    assert (stored["start"], stored["stop"]) == (0, 20)


def test_a_stop_that_read_the_chunks_before_a_split_takes_the_new_chunk_out_too(store: Store) -> None:
    create(store)
    item = lease_one(store)

    with before_first_call(store, "stop_job", lambda: cuts.split_chunk(store, item, row=20)):
        job_stops.stop_job(store, "jbig", status="cancelled", error="", now=NOW + 2)

    assert get_job(store, "jbig", now=NOW).chunks_total == 3
    assert ready_ids(store) == []  # the new chunk [20, 50) went with the rest

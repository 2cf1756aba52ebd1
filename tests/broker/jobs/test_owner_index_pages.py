"""The reaper's owner-index backfill (`job_lists.index_job_owners`): bounded passes that miss no job."""

from __future__ import annotations

import dataclasses

from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, job_spec


def store_jobs_without_owner_indexes(store: Store, created: list[float], owners: list[str],
                                     id_prefix: str = "j") -> list[str]:
    """Jobs as a release without per-owner indexes stored them; their ids, oldest first."""
    ids = [f"{id_prefix}{i:05d}" for i in range(len(created))]
    for job_id, at, owner in zip(ids, created, owners, strict=True):
        job_fills.create_job(store, dataclasses.replace(job_spec(job_id, rows_total=1, chunk_size=1), owner=owner),
                             now=at)
    store.client.delete(*(store.keys.owner_jobs(owner, owner) for owner in set(owners)))
    return ids


def test_passes_index_every_job_of_a_run_of_equal_creation_times_longer_than_a_page(store: Store) -> None:
    """2,500 jobs created at one instant (a bulk import, or an older API process under load): the first
    pass indexes a page of them, the second resumes after its last job, not after its creation time."""
    ids = store_jobs_without_owner_indexes(store, [NOW] * 2500, ["alice", "bob"] * 1250)

    assert job_lists.INDEX_PAGE < 2500
    assert [job_lists.index_job_owners(store) for _ in range(2)] == [False, True]

    assert store.client.zcard(store.keys.owner_jobs("alice", "alice")) == 1250
    assert store.client.zcard(store.keys.owner_jobs("bob", "bob")) == 1250
    assert store.client.zscore(store.keys.owner_jobs("bob", "bob"), ids[-1]) == NOW  # scored by creation time
    assert store.client.exists(store.keys.owner_index_built)
    listed = [job.id for job in job_lists.list_jobs(store, now=NOW, owner="alice", limit=2000)]
    assert sorted(listed) == ids[0::2]


def test_a_pass_indexes_at_most_a_page_and_the_jobs_created_after_a_catch_up(store: Store) -> None:
    """Runs of equal times across page ends: each pass adds at most its page, together they add every
    job once; later passes index only jobs stored after the catch-up without their owner's index."""
    created = [NOW + i // 7 for i in range(50)]  # runs of 7 equal times, pages of 5
    ids = store_jobs_without_owner_indexes(store, created, ["alice"] * 50)
    owner_jobs = store.keys.owner_jobs("alice", "alice")

    indexed = []
    while not job_lists.index_job_owners(store, limit=5):
        indexed.append(store.client.zcard(owner_jobs))
    assert indexed == list(range(5, 55, 5))  # one page a pass, none skipped, none twice (the 10th is full)
    assert store.client.zrange(owner_jobs, 0, -1, withscores=True) == list(zip(ids, created, strict=True))

    late = store_jobs_without_owner_indexes(store, [NOW + 100] * 3, ["carol"] * 3, "k")  # by an older API process
    assert job_lists.index_job_owners(store, limit=5)
    assert store.client.zrange(store.keys.owner_jobs("carol", "carol"), 0, -1) == late


def test_a_mark_written_as_a_creation_time_by_an_earlier_release_starts_the_walk_again(store: Store) -> None:
    """Earlier releases kept the creation time indexed up to, and could skip jobs of a long run of equal
    times: a mark that names no job restarts the walk from the oldest job, which indexes those too."""
    ids = store_jobs_without_owner_indexes(store, [NOW] * 6 + [NOW + 1], ["alice"] * 7)
    store.client.zadd(store.keys.owner_jobs("alice", "alice"), {job_id: NOW for job_id in ids[:2]})  # what was indexed
    store.client.set(store.keys.owner_index_mark, repr(NOW))

    assert not job_lists.index_job_owners(store, limit=4)
    assert job_lists.index_job_owners(store, limit=4)

    assert store.client.zrange(store.keys.owner_jobs("alice", "alice"), 0, -1) == ids

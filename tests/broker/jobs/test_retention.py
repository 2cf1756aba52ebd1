"""Ended jobs are forgotten once `jobs.retention` has passed; active ones and recent ones stay."""

from __future__ import annotations

import pytest

from broker.errors import JobNotFound
from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import output_dirs
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.jobs.retention import forget_ended_jobs
from broker.state.store import Store

NOW = 1_800_000_000.0
DAY = 86_400.0


def create(store: Store, job_id: str, *, at: float, output_dir: str) -> None:
    spec = jobs.JobSpec(job_id=job_id, model_name="mlp", model_version="v1", input_batch="/in.npy", input_format="npy",
                        input_checksum="sha256:0", output_dir=output_dir, output_names=["y"], rows_total=4,
                        chunk_size=2, batch_size=2, owner="alice", tenant="acme")
    output_dirs.claim_output_dir(store, output_dir, job_id, caller={"name": "alice", "role": "user", "tenant": "acme"})
    job_fills.create_job(store, spec, now=at)


def test_a_job_ended_longer_ago_than_the_retention_is_forgotten_whole(store: Store) -> None:
    create(store, "j00000000000a", at=NOW - 9 * DAY, output_dir="/out/a")
    create(store, "j00000000000b", at=NOW - 9 * DAY, output_dir="/out/b")
    create(store, "j00000000000c", at=NOW - 9 * DAY, output_dir="/out/c")
    job_stops.stop_job(store, "j00000000000a", status="cancelled", error="by the user", now=NOW - 8 * DAY)
    job_stops.stop_job(store, "j00000000000b", status="cancelled", error="by the user", now=NOW - 1 * DAY)
    job_lists.count_old_jobs(store)
    before = job_lists.job_status_counts(store)

    assert forget_ended_jobs(store, now=NOW, retention=7 * DAY) == ["j00000000000a"]

    with pytest.raises(JobNotFound):
        jobs.get_job(store, "j00000000000a", now=NOW)
    assert not store.client.exists(store.keys.job_done("j00000000000a"))
    assert store.client.zscore(store.keys.jobs, "j00000000000a") is None
    assert store.client.zscore(store.keys.owner_jobs("acme", "alice"), "j00000000000a") is None
    assert not store.client.hexists(store.keys.output_dirs, "/out/a")
    assert before is not None and job_lists.job_status_counts(store) == before | {"cancelled": 1}
    assert [job.id for job in job_lists.list_jobs(store, now=NOW)] == ["j00000000000c", "j00000000000b"]  # kept:
    # one ended a day ago, one still queued however old
    assert forget_ended_jobs(store, now=NOW, retention=0) == []  # 0 keeps every job

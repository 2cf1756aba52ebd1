"""The reaper pass records a lost lease on its job as a `worker_lost` failure and queues the chunk again
by `retry.worker_lost` (real Redis, a real `WorkerContext`, the real `reaper.reap` pass, time
passed in)."""

from __future__ import annotations

import time
from pathlib import Path

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.state.store import Store
from sits_worker.upkeep import reaper
from tests.leasing import lease_items
from tests.worker.worker_helpers import mlp_worker_context


def _job(store: Store) -> jobs.JobSpec:
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1", input_batch="/data/in.npy",
                        input_format="npy", input_checksum="sha256:0", output_dir="/data/out",
                        output_names=["logits"], rows_total=8, chunk_size=8, batch_size=8)
    job_fills.create_job(store, spec, now=time.time())
    return spec


def test_a_lost_lease_is_queued_again_at_once_and_recorded_on_its_job(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)
    spec = _job(store)
    now = time.time()
    [item] = lease_items(store, spec.model_ref, now=now, lease_seconds=1, max_items=1)

    counts = reaper.reap(ctx, [].append, now=now + 2)

    assert counts["returned"] == 1
    assert store.client.zrange(store.keys.ready(spec.model_ref), 0, -1) == [item.item_id]
    job = jobs.get_job(store, spec.job_id, now=now + 2)
    assert job.retries["worker_lost"]["attempts"] == 1 and "lease expired" in job.retries["worker_lost"][
        "last_error"]
    assert job.failures[-1]["retry_at"] == job.failures[-1]["at"]


def test_lost_leases_wait_a_configured_backoff_and_the_last_one_fails_the_job(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        retry={"worker_lost": {"attempts": 2, "backoff": "5s"}}))
    spec = _job(store)
    now = time.time()
    lease_items(store, spec.model_ref, now=now, lease_seconds=1, max_items=1)

    assert reaper.reap(ctx, [].append, now=now + 2)["returned"] == 0  # waits 5 s first
    assert reaper.reap(ctx, [].append, now=now + 7)["returned"] == 1
    lease_items(store, spec.model_ref, now=now + 7, lease_seconds=1, max_items=1)
    assert reaper.reap(ctx, [].append, now=now + 9)["dead"] == 1

    job = jobs.get_job(store, spec.job_id, now=now + 9)
    assert job.status == "failed" and "failed 2 times" in job.error
    assert job.retries["worker_lost"]["attempts"] == 2
    assert [entry["retry_at"] is None for entry in job.failures] == [False, True]  # the second failed the job

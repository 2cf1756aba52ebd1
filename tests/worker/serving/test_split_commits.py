"""A chunk run twice (its lease reaped) while one run splits it: the other run's commit writes and counts only
the chunk's rows as split (`execution.commit_chunk`, `broker.jobs.cuts`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from broker.config.settings import Settings
from broker.jobs import cuts
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.queueing import leases
from broker.queueing.leases import LeaseOptions
from broker.state.store import Store
from sits_worker.serving.execution import commit_chunk
from tests.worker.worker_helpers import mlp_worker_context


def test_a_stale_runs_commit_writes_and_counts_the_chunks_rows_as_split(store: Store, zoo_dir: Path,
                                                                         tmp_path: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(jobs={"split_chunks": True}))
    np.save(tmp_path / "in.npy", np.zeros((100, 64), np.float32))
    spec = jobs.JobSpec(job_id="jsplit", model_name="mlp", model_version="v1", input_batch=str(tmp_path / "in.npy"),
                        input_format="npy", input_checksum="sha256:0", output_dir=str(tmp_path / "out"),
                        output_names=["logits"], rows_total=100, chunk_size=50, batch_size=10, owner="k1",
                        tenant="t1")
    job_fills.create_job(store, spec, now=time.time())
    [item] = leases.lease_batch(store, "mlp@v1", LeaseOptions(max_items=8, max_chunks=1), now=time.time(),
                                lease_seconds=30).items
    stale = dataclasses.replace(item, payload=dict(item.payload))  # a second run of it, read before the split
    job = jobs.get_job(store, "jsplit", now=time.time())
    assert cuts.split_chunk(store, item, row=20).split

    outcome = commit_chunk(ctx, job, stale, {"logits": np.ones((50, 10), np.float32)})

    assert outcome == "acked"
    [part] = (tmp_path / "out" / ".parts" / "jsplit").glob("logits.*.npy")
    assert np.load(part).shape == (20, 10)
    assert jobs.get_job(store, "jsplit", now=time.time()).rows_done == 20

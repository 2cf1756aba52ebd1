"""A job ready for its final merge, for tests of the finalize step (real Redis, real part files)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.queueing import leases
from broker.state.store import Store
from sits_worker.serving import outputs
from tests.leasing import lease_items


def leased_finalize_item(store: Store, output_dir: Path, *, chunks: int, lease_seconds: float = 60.0
                         ) -> leases.LeasedItem:
    """A job of `chunks` one-row chunks whose parts (row i holds i) are written and acked; its finalize
    item, leased for `lease_seconds`."""
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1", input_batch="/data/in.npy",
                        input_format="npy", input_checksum="sha256:0123abcd", output_dir=str(output_dir),
                        output_names=["logits"], rows_total=chunks, chunk_size=1, batch_size=1)
    job_fills.create_job(store, spec, now=time.time())
    for item in lease_items(store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=chunks):
        chunk = item.payload["chunk"]
        outputs.write_part(output_dir, chunk, {"logits": np.full((1, 2), chunk, np.float32)}, job_id=spec.job_id)
        job_progress.ack_chunk(store, item, now=time.time(), worker="w1")
    [final] = lease_items(store, spec.model_ref, now=time.time(), lease_seconds=lease_seconds, max_items=1)
    assert final.payload["kind"] == "finalize"
    return final

"""A chunk whose ack was lost (a Redis failover dropped it, or it failed while Redis was away) has its parts
on disk: leased again, it is acked from them, not run and written again (real Redis, a real
`WorkerContext`, the zoo MLP)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from broker.jobs import fills as job_fills
from broker.jobs import output_layout
from broker.jobs import records as jobs
from broker.queueing import reaping
from broker.state.store import Store
from sits_worker.serving import execution
from sits_worker.serving.between_minibatches import BetweenBatches
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item
from tests.leasing import lease_items
from tests.worker.worker_helpers import mlp_worker_context


@pytest.fixture
def job(store: Store, zoo_dir: Path, tmp_path: Path) -> tuple[WorkerContext, jobs.JobSpec]:
    """A 64-row MLP job in two chunks of 32."""
    ctx = mlp_worker_context(store, zoo_dir)
    np.save(tmp_path / "in.npy", np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32))
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                        input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                        output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=64, chunk_size=32,
                        batch_size=16)
    job_fills.create_job(store, spec, now=time.time())
    return ctx, spec


def _run_next(ctx: WorkerContext, model_ref: str, now: float) -> str:
    [item] = lease_items(ctx.store, model_ref, now=now, lease_seconds=60, max_items=1)
    outcome = process_item(ctx, item, BetweenBatches(ctx, item, ticket=""))
    assert ctx.commits.wait(timeout=10)
    return outcome


def test_a_chunk_whose_ack_was_lost_is_acked_from_its_parts_without_running_again(
        job: tuple[WorkerContext, jobs.JobSpec], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, spec = job
    acks = execution.job_progress.ack_chunk
    monkeypatch.setattr(execution.job_progress, "ack_chunk", lambda *args, **kwargs: None)  # the ack never lands
    now = time.time()
    _run_next(ctx, spec.model_ref, now)
    part = output_layout.part_path(Path(spec.output_dir), "logits", 0, spec.job_id)
    written = part.stat()
    monkeypatch.setattr(execution.job_progress, "ack_chunk", acks)
    assert jobs.get_job(ctx.store, spec.job_id, now=now).chunks_done == 0

    # its lease runs out and the reaper returns it, as after a failover that lost the ack
    assert reaping.reap_expired_leases(ctx.store, now=now + 61, max_attempts=3).returned == 1
    ran = []
    monkeypatch.setattr(execution, "run_chunk", lambda *args: ran.append(args) or pytest.fail("ran again"))
    assert _run_next(ctx, spec.model_ref, now + 62) == "acked"

    assert not ran and jobs.get_job(ctx.store, spec.job_id, now=now).chunks_done == 1
    again = part.stat()
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)  # not written twice


@pytest.mark.parametrize("amiss", ["rows", "link"])
def test_a_part_that_is_not_the_chunk_s_whole_output_is_no_checkpoint(
        job: tuple[WorkerContext, jobs.JobSpec], tmp_path: Path, amiss: str) -> None:
    ctx, spec = job
    part = output_layout.part_path(Path(spec.output_dir), "logits", 0, spec.job_id)
    part.parent.mkdir(parents=True)
    if amiss == "rows":
        np.save(part, np.zeros((31, 10), dtype=np.float32))  # a chunk of 32 rows
    else:
        np.save(tmp_path / "elsewhere.npy", np.zeros((32, 10), dtype=np.float32))
        os.symlink(tmp_path / "elsewhere.npy", part)
    assert _run_next(ctx, spec.model_ref, time.time()) == "committing"  # run, and written
    assert not part.is_symlink() and np.load(part).shape == (32, 10)

"""A computed chunk is committed (parts written durably, then acked) on one of the worker's commit threads,
while its stream slot goes on (real Redis, a real `WorkerContext`, a real ONNX model)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import output_layout
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.models import registry
from broker.queueing import leases, reaping, tickets
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.model.graph import static_profile
from sits_worker.serving import outputs
from sits_worker.serving.between_minibatches import BetweenBatches
from sits_worker.serving.chunk_commits import Commits
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item
from tests.leasing import lease_items


def test_a_slot_waits_for_room_while_max_pending_commits_are_queued() -> None:
    commits, release, ran = Commits(max_pending=1), threading.Event(), []
    commits.submit(lambda: (release.wait(5), ran.append(1)))
    commits.submit(lambda: ran.append(2))  # submitting never blocks: the slot holds memory then
    waiter = threading.Thread(target=commits.wait_for_room)
    waiter.start()

    waiter.join(0.2)
    assert waiter.is_alive() and commits.pending() == 2  # the next admission waits for the disk
    assert not commits.wait(timeout=0.05)
    release.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert commits.wait(timeout=5) and ran == [1, 2] and commits.pending() == 0


def test_commits_of_two_slots_are_written_side_by_side() -> None:
    """A job's last chunks end on every slot at about the same time: one commit does not wait for the
    other's disk (each waits here for the other to have begun)."""
    commits, both_running, ran = Commits(max_pending=2), threading.Barrier(2, timeout=5), []
    for index in range(2):
        commits.submit(lambda index=index: (both_running.wait(), ran.append(index)))
    assert commits.wait(timeout=10) and sorted(ran) == [0, 1]


def test_a_commit_that_raises_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    commits, ran = Commits(max_pending=2), []
    commits.submit(lambda: 1 / 0)
    commits.submit(lambda: ran.append("next"))
    assert commits.wait(timeout=5) and ran == ["next"]
    assert "commit failed unexpectedly" in caplog.text


@pytest.fixture
def mlp_job(store: Store, zoo_dir: Path, tmp_path: Path) -> tuple[WorkerContext, jobs.JobSpec, np.ndarray]:
    """The zoo MLP registered, and a 64-row job over it in two chunks."""
    model = onnx.load(str(zoo_dir / "mlp.onnx"))
    profile = static_profile(model)
    registry.save_model_version(store, {"name": "mlp", "version": "v1", "ref": "mlp@v1",
                                        "path": str(zoo_dir / "mlp.onnx"), "signature": profile["signature"],
                                        "static_profile": profile})
    rows = np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32)
    np.save(tmp_path / "in.npy", rows)
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                        input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                        output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=64, chunk_size=32,
                        batch_size=16)
    job_fills.create_job(store, spec, now=time.time())
    ctx = WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                        sessions=SessionCache(Device("cpu"), 1))
    return ctx, spec, rows


def run_next(ctx: WorkerContext, model_ref: str) -> str:
    [item] = lease_items(ctx.store, model_ref, now=time.time(), lease_seconds=60, max_items=1)
    return process_item(ctx, item, BetweenBatches(ctx, item, ticket=""))


def test_the_slot_goes_on_while_its_chunk_is_made_durable_and_the_ack_waits_for_the_disk(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, spec, rows = mlp_job
    disk = threading.Event()
    fsync = outputs.os.fsync
    monkeypatch.setattr(outputs.os, "fsync", lambda fd: (disk.wait(10), fsync(fd)))

    assert run_next(ctx, spec.model_ref) == "committing"  # computed; its part is not on disk yet

    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.chunks_done == 0 and ctx.commits.pending() == 1
    assert not output_layout.part_exists(Path(spec.output_dir), 0, ["logits"], job_id=spec.job_id)
    disk.set()
    assert ctx.commits.wait(timeout=10)
    assert jobs.get_job(ctx.store, spec.job_id, now=time.time()).chunks_done == 1

    # the job's last chunk: its slot waits for the commit, so the finalize step its ack queues comes next
    assert run_next(ctx, spec.model_ref) == "acked"
    assert ctx.commits.pending() == 0
    assert run_next(ctx, spec.model_ref) == "finalized"  # queued by the last chunk's ack
    session = ort.InferenceSession(str(Path(ctx.model(spec.model_ref).path)), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(np.load(Path(spec.output_dir) / "logits.npy"), session.run(None, {"features": rows})[0],
                               rtol=1e-5, atol=1e-6)


def test_a_commit_that_cannot_write_leaves_the_chunk_to_be_retried(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, spec, _ = mlp_job

    def full_disk(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs, "_write_atomically", full_disk)

    assert run_next(ctx, spec.model_ref) == "committing"
    assert ctx.commits.wait(timeout=10)

    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.chunks_done == 0 and "No space left" in (job_progress.last_error(ctx.store, spec.job_id) or "")
    # A full disk is transient: the chunk waits out that class's backoff (2 s + up to 1 s), then the
    # reaper puts it back for another attempt.
    assert job.retries["transient"]["attempts"] == 1
    assert reaping.reap_expired_leases(ctx.store, now=time.time(), max_attempts=3).returned == 0
    assert reaping.reap_expired_leases(ctx.store, now=time.time() + 3.1, max_attempts=3).returned == 1


def test_a_commit_drops_a_chunk_whose_job_stopped_while_it_waited(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray]) -> None:
    """No part is left in a folder that nobody merges any more, and the chunk leaves its queue."""
    ctx, spec, _ = mlp_job
    gate = threading.Event()
    ctx.commits.submit(lambda: gate.wait(10))  # the disk is busy with another chunk's commit

    assert run_next(ctx, spec.model_ref) == "committing"
    job_stops.stop_job(ctx.store, spec.job_id, status="cancelled", error="", now=time.time())
    gate.set()
    assert ctx.commits.wait(timeout=10)

    assert not (Path(spec.output_dir) / outputs.PARTS_DIR).exists()
    assert jobs.get_job(ctx.store, spec.job_id, now=time.time()).chunks_done == 0
    assert ctx.store.client.zcard(ctx.store.keys.inflight(spec.model_ref)) == 0


def test_a_drain_task_keeps_its_ticket_until_its_commits_are_done(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """The last chunk's ack queues the job's finalize step from the commit thread, after the queues ran
    dry; a drain task that retired its ticket meanwhile would leave the step to the next reaper pass."""
    from sits_worker.serving import drain_loop, execution

    ctx, spec, _ = mlp_job
    ctx.settings = ctx.settings.with_overrides(scheduler={"ticket_linger": 0.1})
    write_part = execution.write_part
    monkeypatch.setattr(execution, "write_part", lambda *args, **kwargs: (time.sleep(0.5),
                                                                          write_part(*args, **kwargs)))
    [ticket] = tickets.top_up_tickets(ctx.store, now=time.time(), target=1)

    assert drain_loop.drain(ctx, ticket) == "released"

    assert jobs.get_job(ctx.store, spec.job_id, now=time.time()).status == "succeeded"


def test_a_drain_task_retires_once_a_commit_that_queues_nothing_is_done(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's other chunk runs elsewhere, so this commit's ack rings no doorbell: the lingering
    task must still look again and retire (a blocking pop of ~1 ms used to mean 'forever' on Redis 6)."""
    from sits_worker.serving import drain_loop, execution

    ctx, spec, _ = mlp_job
    ctx.settings = ctx.settings.with_overrides(scheduler={"ticket_linger": 0.1})
    first, _ = lease_items(ctx.store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=2)
    leases.return_unrun(ctx.store, [first])  # chunk 0 waits again; chunk 1 stays with another worker
    write_part = execution.write_part
    monkeypatch.setattr(execution, "write_part", lambda *args, **kwargs: (time.sleep(0.5),
                                                                          write_part(*args, **kwargs)))
    [ticket] = tickets.top_up_tickets(ctx.store, now=time.time(), target=1)
    ctx.store.client.delete(ctx.store.keys.doorbell)
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(drain_loop.drain(ctx, ticket)), daemon=True)

    runner.start()
    runner.join(10)

    assert outcome == ["released"]
    assert jobs.get_job(ctx.store, spec.job_id, now=time.time()).chunks_done == 1


def test_a_chunk_whose_input_changed_since_submit_fails_its_job_before_reading_it(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray]) -> None:
    """Rewritten, its rows would mix with the old ones under the old checksum; cut short, the read
    would run past the end of its memory map and crash the worker. Either way a stat tells."""
    from sits_worker.model.source import file_identity

    ctx, spec, rows = mlp_job
    path = Path(spec.input_batch)
    ctx.store.client.hset(ctx.store.keys.job(spec.job_id), "input_stat", json.dumps(file_identity(path)))
    assert run_next(ctx, spec.model_ref) == "committing"  # unchanged: runs
    assert ctx.commits.wait(timeout=10)
    np.save(path, rows[:40])  # cut short between its chunks

    assert run_next(ctx, spec.model_ref) == "failed"
    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.status == "failed" and "changed after the job was submitted" in job.error, job

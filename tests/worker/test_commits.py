"""A computed chunk is committed (parts written durably, then acked) on the worker's commit thread,
while its stream slot goes on (real Redis, a real `WorkerContext`, a real ONNX model)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from broker import jobs, queues, registry
from broker.config import Settings
from broker.store import Store
from sits_worker import outputs
from sits_worker.between import BetweenBatches
from sits_worker.commits import Commits
from sits_worker.context import WorkerContext
from sits_worker.devices import Device
from sits_worker.execution import process_item
from sits_worker.model.graph import static_profile
from sits_worker.runtime import SessionCache


def test_a_slot_queues_at_most_max_pending_commits_and_waits_for_room() -> None:
    commits, release, ran = Commits(max_pending=1), threading.Event(), []
    commits.submit(lambda: (release.wait(5), ran.append(1)))
    second = threading.Thread(target=commits.submit, args=(lambda: ran.append(2),))
    second.start()

    second.join(0.2)
    assert second.is_alive() and commits.pending() == 1  # the second slot waits for room
    assert not commits.wait(timeout=0.05)
    release.set()
    second.join(5)
    assert commits.wait(timeout=5) and ran == [1, 2] and commits.pending() == 0


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
    jobs.create_job(store, spec, now=time.time())
    ctx = WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                        sessions=SessionCache(Device("cpu"), 1))
    return ctx, spec, rows


def run_next(ctx: WorkerContext, model_ref: str) -> str:
    [item] = queues.lease_batch(ctx.store, model_ref, now=time.time(), lease_seconds=60, max_items=1)
    return process_item(ctx, item, BetweenBatches(ctx, item, ticket=""))


def test_the_slot_goes_on_while_its_chunk_is_made_durable_and_the_ack_waits_for_the_disk(
        mlp_job: tuple[WorkerContext, jobs.JobSpec, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, spec, rows = mlp_job
    disk = threading.Event()
    fsync = outputs.os.fsync
    monkeypatch.setattr(outputs.os, "fsync", lambda fd: (disk.wait(10), fsync(fd)))

    assert run_next(ctx, spec.model_ref) == "committing"  # computed; its part is not on disk yet

    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job["chunks_done"] == 0 and ctx.commits.pending() == 1
    assert not outputs.part_exists(Path(spec.output_dir), 0, ["logits"], job_id=spec.job_id)
    disk.set()
    assert ctx.commits.wait(timeout=10)
    assert jobs.get_job(ctx.store, spec.job_id, now=time.time())["chunks_done"] == 1

    assert run_next(ctx, spec.model_ref) == "committing"
    assert ctx.commits.wait(timeout=10)
    assert run_next(ctx, spec.model_ref) == "finalized"  # queued by the last chunk's ack
    session = ort.InferenceSession(str(Path(ctx.model(spec.model_ref)["path"])), providers=["CPUExecutionProvider"])
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
    assert job["chunks_done"] == 0 and "No space left" in (jobs.last_error(ctx.store, spec.job_id) or "")
    # Its lease expired at once: the next reaper pass puts it back for another attempt.
    assert queues.reap_expired_leases(ctx.store, now=time.time(), max_attempts=3).returned == 1

"""Workers leaving mid-job: one stopped by SIGTERM (a scale-down or a rolling update) finishes what it runs
and exits in time with no lease left behind; one SIGKILLed loses nothing either. The job succeeds and every
row equals a direct ONNX Runtime run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker.queueing import queues
from tests.e2e.stack_helpers import direct_run, register, start_stack, wait_job

ROWS = 20_000
CHUNK = 500
BATCH = 100
SEQUENCE = 16
GRACE_SECONDS = 10.0
"""What the test allows a SIGTERMed worker to exit in: well within Kubernetes' default grace of 30 s."""


@pytest.fixture
def stack(tmp_path, zoo_dir):
    running = start_stack(tmp_path / "home", workers=2, streams=1, model_roots=(zoo_dir,))
    yield running
    running.stop()


def test_job_survives_a_worker_stopped_and_one_killed_mid_run(stack, tmp_path, zoo_dir):
    client = stack.client()
    register(client, "transformer", zoo_dir / "transformer.onnx")
    ref = f"transformer@{client.get('/v1/models/transformer')['version']}"
    token_ids = np.random.default_rng(3).integers(0, 1000, size=(ROWS, SEQUENCE)).astype(np.int64)
    data = stack.home / "token_ids.npy"
    np.save(data, token_ids)
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(data),
                                   "output_dir": str(stack.home / "out"), "chunk_size": CHUNK, "batch_size": BATCH})

    mid = wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= 6)
    assert mid["status"] == "running", mid
    # SIGTERM (warm shutdown): the worker leases nothing more, finishes its chunk and exits by itself
    stopping = next(child for child in stack.children if child.name == "worker1")
    began = time.monotonic()
    stack.stop_child("worker1", timeout=GRACE_SECONDS + 5)
    exited_in = time.monotonic() - began
    leased_after = queues.queue_depths(stack.store).get(ref, {}).get("inflight", 0)
    assert exited_in < GRACE_SECONDS and stopping.process.returncode == 0, (exited_in, stopping.process.returncode)
    assert "warm shutdown: leasing stopped" in (stack.home / "logs" / "worker1.log").read_text()
    assert leased_after <= 1, f"{leased_after} chunks leased with one single-slot worker left: a lease was left behind"

    further = wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= mid["chunks_done"] + 4)
    assert further["status"] == "running", further
    stack.stop_child("worker0", kill=True)  # SIGKILL: its leased chunk is only recovered by lease expiry
    stack.start_worker(2)
    done = wait_job(client, job["id"], timeout=240)

    assert done["status"] == "succeeded", done
    assert done["rows_done"] == ROWS and done["chunks_done"] == done["chunks_total"] == ROWS // CHUNK
    assert done["manifest"]["rows"] == ROWS
    outputs = np.load(stack.home / "out" / "embedding.npy")
    expected = direct_run(zoo_dir / "transformer.onnx", token_ids, BATCH)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)
    assert len(done["workers"]) == 3, "each worker ran chunks: the stopped, the killed and the new one"


def test_a_parquet_job_survives_a_killed_worker_with_every_id_and_row_once(stack, zoo_dir):
    """A table job (16 token columns and an id column, Parquet out): its worker SIGKILLed mid-run, another
    started. Its leased chunk comes back by lease expiry; outputs.parquet holds every id once, in row order,
    with embeddings equal to a direct run, and only the killed worker's chunks ran twice."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    client = stack.client()
    register(client, "transformer", zoo_dir / "transformer.onnx")
    token_ids = np.random.default_rng(4).integers(0, 1000, size=(ROWS, SEQUENCE)).astype(np.int64)
    ids = np.arange(ROWS, dtype=np.int64) * 7 + 1_000_000
    table = pa.table({"doc": ids, **{f"t{i:02d}": token_ids[:, i] for i in range(SEQUENCE)}})
    pq.write_table(table, stack.home / "tokens.parquet", row_group_size=3_000)  # (groups cut across chunks)
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "tokens.parquet"),
                                   "output_dir": str(stack.home / "out-table"), "chunk_size": CHUNK,
                                   "batch_size": BATCH, "id_column": "doc", "output_format": "parquet"})

    mid = wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= 6)
    assert mid["status"] == "running", mid
    stack.stop_child("worker0", kill=True)
    stack.start_worker(2)
    done = wait_job(client, job["id"], timeout=240)

    assert done["status"] == "succeeded" and done["rows_done"] == ROWS, done
    assert done["chunk_runs"] <= done["chunks_total"] + 2, done  # (what the killed worker held ran again)
    written = pq.read_table(stack.home / "out-table" / "outputs.parquet")
    assert written["doc"].to_pylist() == ids.tolist()
    embeddings = np.asarray(written["embedding"].combine_chunks().flatten()).reshape(ROWS, -1)
    expected = direct_run(zoo_dir / "transformer.onnx", token_ids, BATCH)
    np.testing.assert_allclose(embeddings, expected.reshape(ROWS, -1), rtol=1e-5, atol=1e-5)

"""A worker SIGKILLed mid-job: the job still succeeds, every row equals a direct ONNX Runtime run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.stack_helpers import direct_run, register, start_stack, wait_job

ROWS = 20_000
CHUNK = 500
BATCH = 100
SEQUENCE = 16


@pytest.fixture
def stack(tmp_path, zoo_dir):
    running = start_stack(tmp_path / "home", workers=2, streams=1, model_roots=(zoo_dir,))
    yield running
    running.stop()


def test_job_survives_a_worker_killed_mid_run(stack, tmp_path, zoo_dir):
    client = stack.client()
    register(client, "transformer", zoo_dir / "transformer.onnx")
    token_ids = np.random.default_rng(3).integers(0, 1000, size=(ROWS, SEQUENCE)).astype(np.int64)
    data = stack.home / "token_ids.npy"
    np.save(data, token_ids)
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(data),
                                   "output_dir": str(stack.home / "out"), "chunk_size": CHUNK, "batch_size": BATCH})

    mid = wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= 6)
    assert mid["status"] == "running", mid
    stack.stop_child("worker0", kill=True)  # SIGKILL: its leased chunk is only recovered by lease expiry
    done = wait_job(client, job["id"], timeout=240)

    assert done["status"] == "succeeded", done
    assert done["rows_done"] == ROWS and done["chunks_done"] == done["chunks_total"] == ROWS // CHUNK
    assert done["manifest"]["rows"] == ROWS
    outputs = np.load(stack.home / "out" / "embedding.npy")
    expected = direct_run(zoo_dir / "transformer.onnx", token_ids, BATCH)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)
    assert len(done["workers"]) == 2, "both workers ran chunks before one was killed"

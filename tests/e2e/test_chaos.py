"""Soak: workers SIGKILLed and restarted again and again during one job; every row exactly once."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.e2e.stack_helpers import direct_run, register, start_stack, wait_job

ROWS = 60_000
CHUNK = 500
BATCH = 100
SEQUENCE = 48  # long enough that the job outlasts two kills on a quiet machine


@pytest.mark.slow
def test_repeated_worker_kills_lose_and_duplicate_nothing(tmp_path, zoo_dir):
    stack = start_stack(tmp_path / "home", workers=2, streams=2, model_roots=(zoo_dir,))
    try:
        client = stack.client()
        register(client, "transformer", zoo_dir / "transformer.onnx")
        token_ids = np.random.default_rng(9).integers(0, 1000, size=(ROWS, SEQUENCE)).astype(np.int64)
        np.save(stack.home / "ids.npy", token_ids)
        job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "ids.npy"),
                                       "output_dir": str(stack.home / "out"), "chunk_size": CHUNK,
                                       "batch_size": BATCH})
        kills = 0
        while client.get(f"/v1/jobs/{job['id']}")["status"] not in ("succeeded", "failed") and kills < 6:
            time.sleep(1.5)
            victim = kills % 2
            stack.stop_child(f"worker{victim}", kill=True)
            stack.start_worker(victim)
            kills += 1
        done = wait_job(client, job["id"], timeout=300)
    finally:
        stack.stop()

    assert kills >= 2, "the job ended before the workers could be killed twice; make it longer"
    assert done["status"] == "succeeded", done
    assert done["chunks_done"] == done["chunks_total"] and done["rows_done"] == ROWS
    assert done["chunk_runs"] >= done["chunks_total"]  # re-runs are allowed, double counting is not
    expected = direct_run(zoo_dir / "transformer.onnx", token_ids, BATCH)
    np.testing.assert_allclose(np.load(stack.home / "out" / "embedding.npy"), expected, rtol=1e-5, atol=1e-5)

"""Everything killed mid-job (workers, API and Redis with AOF), restarted: the job goes on by itself.

Nobody calls `resume`: the restarted workers' reaper returns the dead run's expired leases. Only the
unfinished chunks run again (counted by the job's `chunk_runs`, which every chunk ack increments), and
the outputs equal a direct run.
"""

from __future__ import annotations

import time

import numpy as np

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job

ROWS = 20_000
CHUNK = 500
BATCH = 100
SEQUENCE = 16


def _kill_everything(stack: Stack) -> None:
    for child in list(stack.children):
        stack.stop_child(child.name, kill=True)
    time.sleep(1.2)  # appendfsync everysec: let the last second reach the AOF, as a real crash might not
    stack.redis.stop(kill=True)


def test_after_a_crash_of_everything_the_job_resumes_by_itself_and_reruns_only_unfinished_chunks(tmp_path, zoo_dir):
    home = tmp_path / "home"
    settings = stack_settings(home, streams=1, model_roots=(zoo_dir,))
    first = Stack(settings, worker_count=2, api_port=0).start()
    try:
        client = first.client()
        register(client, "transformer", zoo_dir / "transformer.onnx")
        token_ids = np.random.default_rng(5).integers(0, 1000, size=(ROWS, SEQUENCE)).astype(np.int64)
        np.save(home / "token_ids.npy", token_ids)
        job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(home / "token_ids.npy"),
                                       "output_dir": str(home / "out"), "chunk_size": CHUNK, "batch_size": BATCH})
        wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= 8)
        _kill_everything(first)
    finally:
        first.stop()

    second = Stack(settings, worker_count=2, api_port=0).start()
    try:
        client = second.client()
        before = client.get(f"/v1/jobs/{job['id']}")
        assert before["status"] == "running" and 0 < before["chunks_done"] < before["chunks_total"], before
        done = wait_job(client, job["id"], timeout=240)  # (no resume call)
    finally:
        second.stop()

    assert done["status"] == "succeeded", done
    reruns = done["chunk_runs"] - before["chunk_runs"]
    assert reruns == before["chunks_total"] - before["chunks_done"], (before, done)
    outputs = np.load(home / "out" / "embedding.npy")
    expected = direct_run(zoo_dir / "transformer.onnx", token_ids, BATCH)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)

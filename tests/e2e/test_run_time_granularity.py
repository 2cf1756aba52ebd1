"""Granularity chosen as jobs run, through a real stack: small jobs of one tenant share runs (run units,
`jobs.merge_chunks`), and a chunk far longer than planned ends early, its rest queued as new chunks
(`jobs.split_chunks`); both are off by default and on here."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from broker.monitoring.batch_sizes import decode_batch_sizes
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import direct_run, stack_settings, wait_job
from tests.waiting import eventually


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("granularity") / "home"
    settings = stack_settings(home, streams=2).with_overrides(jobs={"split_chunks": True, "merge_chunks": 16})
    running = Stack(settings, worker_count=1, api_port=0).start()
    build_zoo(home / "models")
    yield running
    running.stop()


def register(client, name: str, path, profile_mode: str = "static") -> dict:
    record = client.post("/v1/models", {"name": name, "path": str(path), "profile_mode": profile_mode})
    while record["profile_status"] == "pending":
        time.sleep(0.2)
        record = client.get(f"/v1/models/{record['ref']}")
    assert record["profile_status"] in ("ready", "static"), record
    return record


def test_small_jobs_waiting_together_share_runs_and_each_writes_its_own_outputs(stack):
    """Six jobs of three rows wait together (their model barred a moment by a live override); one lease takes
    them as a run unit (`jobs.merge_chunks`), their rows run in shared mini-batches of eight (runs of more rows
    than any one job has, on the model's batch-size histogram), and each job's outputs are its own rows' as a
    direct run gives them."""
    from broker.tuning import live

    client = stack.client()
    record = register(client, "units", stack.home / "models" / "mlp.onnx", "full")  # (a unit needs a rate)
    live.write(stack.store, record["ref"], live.LiveBatching(source="test", until=time.time() + 60,
                                                             others=live.BARRED))
    time.sleep(1.5)  # (workers read overrides every 0.5 s)
    rng, submitted = np.random.default_rng(11), []
    for number in range(6):
        inputs = rng.standard_normal((3, 64)).astype(np.float32)
        np.save(stack.home / f"unit-{number}.npy", inputs)
        job = client.post("/v1/jobs", {"model": "units", "input_batch": str(stack.home / f"unit-{number}.npy"),
                                       "output_dir": str(stack.home / f"out-unit-{number}"), "batch_size": 8})
        submitted.append((job, inputs))
    assert live.clear(stack.store, record["ref"], source="test")

    for job, inputs in submitted:
        assert wait_job(client, job["id"])["status"] == "succeeded"
        [name] = json.loads(stack.store.client.hget(stack.store.keys.job(job["id"]), "output_names"))
        got = np.load(stack.home / f"out-unit-{submitted.index((job, inputs))}" / f"{name}.npy")
        np.testing.assert_allclose(got, direct_run(stack.home / "models" / "mlp.onnx", inputs, 8), rtol=1e-5,
                                   atol=1e-6)

    def shared_runs() -> int:  # runs of more than 4 rows (ROW_BUCKETS: 1, 2, 4, 8, ...)
        raw = stack.store.client.hgetall(stack.store.keys.batch_sizes)
        rows = decode_batch_sizes(raw).get((record["ref"], "rows"))
        return 0 if rows is None else rows.count - rows.cumulative[2]

    assert eventually(shared_runs, timeout=10, interval=0.5) >= 2, "no run held more than one job's rows"


def test_a_chunk_far_longer_than_planned_ends_early_and_its_rest_runs_as_new_chunks(stack):
    """A convnet job submitted as one chunk of 3,072 images (several seconds on a stream, `jobs.chunk_seconds` is
    1 s): the chunk ends at a mini-batch boundary once it has run a second, its rest is queued as a new chunk that
    the other stream takes, and so on (`jobs.split_chunks`). The outputs are a direct run's, merged in row order."""
    client = stack.client()
    register(client, "splitcnn", stack.home / "models" / "convnet.onnx")
    inputs = np.random.default_rng(12).standard_normal((3_072, 3, 32, 32)).astype(np.float32)
    np.save(stack.home / "split-in.npy", inputs)
    job = client.post("/v1/jobs", {"model": "splitcnn", "input_batch": str(stack.home / "split-in.npy"),
                                   "output_dir": str(stack.home / "out-split"), "chunk_size": 3_072, "batch_size": 16})
    assert int(job["chunks_total"]) == 1

    done = wait_job(client, job["id"], timeout=120)

    assert done["status"] == "succeeded" and int(done["chunks_total"]) > 2, done
    manifest = json.loads((stack.home / "out-split" / "manifest.json").read_text())
    assert manifest["chunks"] == int(done["chunks_total"]) and manifest["rows"] == 3_072
    [name] = manifest["outputs"]
    np.testing.assert_allclose(np.load(stack.home / "out-split" / f"{name}.npy"),
                               direct_run(stack.home / "models" / "convnet.onnx", inputs, 16), rtol=1e-4, atol=1e-5)

"""The queue policy through a real stack (Redis, the API under gunicorn, one Celery worker of one stream).

A full queue is a 429 with Retry-After to v1 and v2 clients alike, and everything queued before it is
answered once the worker runs again. Timeouts hold while the worker is busy with a long job chunk: a
`reject` request fails as timed out at its timeout (its waiting client answered then; one nobody waits
for failed by the busy worker's reaper thread), and a `delay` request waits on and runs after the chunk.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.queueing import queues
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import mlp_reference
from tests.e2e.stack_helpers import collect, direct_run, frozen, register, stack_settings, wait_job

MAX_QUEUE_SIZE = 3
CHUNK_SECONDS = 6.0
"""How long the one busy chunk should run: past both timeouts and the reaper's passes that apply them."""
SEQUENCE = 512
TIMEOUT_MS = 300
REAP_INTERVAL = 0.5  # FAST_RECOVERY's


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("queue-policy") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={"yield_check_interval": "1h"},  # a chunk keeps its only stream slot: the worker stays busy
        online={"models": {"mlp": {"max_queue_size": MAX_QUEUE_SIZE},
                           "timed": {"priority_levels": {3: {"timeout_action": "delay"}}}}})
    running = Stack(settings, worker_count=1, api_port=0).start()
    models = build_zoo(home / "models")
    client = running.client()
    for name, model in (("mlp", "mlp"), ("timed", "mlp"), ("transformer", "transformer")):
        register(client, name, models[model])
    yield running
    running.stop_child("worker0", kill=True)  # a chunk still running would hold a warm shutdown up
    running.stop()


def post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(Status, headers, JSON body) of a POST, errors included (the CLI client raises on those)."""
    request = urllib.request.Request(stack.api_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {stack.api_key}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def rows_for(model: Path, seconds: float) -> int:
    """Transformer rows of `SEQUENCE` tokens that take about `seconds` on one ORT thread here (timed on 32
    rows; at least 500, the 6-11 ms rows of a slow two-core machine)."""
    sample = np.random.default_rng(3).integers(1, 1000, size=(32, SEQUENCE)).astype(np.int64)
    direct_run(model, sample[:16], 16)  # warm-up
    started = time.perf_counter()
    direct_run(model, sample, 16)
    return max(500, int(len(sample) / (time.perf_counter() - started) * seconds))


def features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 64)).astype(np.float32)


def v1_body(seed: int) -> dict[str, Any]:
    return {"model": "mlp", "inputs": {"features": features(seed).tolist()}}


def test_a_full_queue_is_a_429_with_retry_after_and_everything_queued_before_it_is_answered(stack: Stack) -> None:
    with frozen(stack, "worker0"):  # nothing leaves the queue while it fills
        accepted = {post(stack, "/v1/requests", v1_body(seed))[2]["id"]: seed for seed in range(MAX_QUEUE_SIZE)}
        v1 = post(stack, "/v1/requests", v1_body(9))
        v2 = post(stack, "/v2/models/mlp/infer", {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32",
                                                              "data": features(9).ravel().tolist()}]})

    for status, headers, body in (v1, v2):
        assert status == 429, body
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert body["code"] == "queue_full" and f"has {MAX_QUEUE_SIZE} requests waiting" in body["error"]
    results = collect(stack.client(), list(accepted))
    for request_id, seed in accepted.items():
        assert results[request_id]["status"] == "succeeded", results[request_id]
        np.testing.assert_allclose(np.array(results[request_id]["outputs"]["logits"]), mlp_reference(features(seed)),
                                   rtol=1e-4, atol=1e-5)


def test_timeouts_hold_while_the_worker_is_busy_reject_fails_them_and_delay_runs_them_later(stack: Stack) -> None:
    client, store = stack.client(), stack.store
    chunk_rows = rows_for(stack.home / "models" / "transformer.onnx", CHUNK_SECONDS)
    tokens = np.random.default_rng(7).integers(1, 1000, size=(chunk_rows, SEQUENCE)).astype(np.int64)
    np.save(stack.home / "tokens.npy", tokens)
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "tokens.npy"),
                                   "output_dir": str(stack.home / "out"), "chunk_size": chunk_rows, "batch_size": 16})
    transformer = f"transformer@{client.get('/v1/models/transformer')['version']}"
    started = time.monotonic() + 30
    while queues.queue_depths(store).get(transformer, {}).get("inflight", 0) < 1:
        assert time.monotonic() < started, "the worker did not lease the chunk"
        time.sleep(0.05)
    one_row = {"model": "timed", "inputs": {"features": features(1).tolist()}, "timeout_ms": TIMEOUT_MS}

    began = time.monotonic()
    status, _, waited = post(stack, "/v1/requests?wait=true", one_row)
    answered_in = time.monotonic() - began
    v2_status, _, v2_body = post(stack, "/v2/models/timed/infer", {
        "inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": features(1).ravel().tolist()}],
        "parameters": {"timeout": TIMEOUT_MS * 1000}})
    unwatched = client.post("/v1/requests", one_row)["id"]
    delayed = client.post("/v1/requests", one_row | {"priority": 3})["id"]
    dealt_with_by = time.monotonic() + TIMEOUT_MS / 1000 + 5 * REAP_INTERVAL  # by the busy worker's reaper
    while client.get(f"/v1/requests/{unwatched}")["status"] == "queued" or json.loads(
            store.client.hget(store.keys.items, delayed))["factors"]["level"] != 0:
        assert time.monotonic() < dealt_with_by, "the reaper did not apply the timeouts while the worker was busy"
        time.sleep(0.05)

    assert status == 200 and (waited["status"], waited["error_code"]) == ("failed", "timeout"), waited
    assert answered_in < TIMEOUT_MS / 1000 + 1.0  # at its timeout, not once the chunk ends
    assert v2_status == 504 and "not taken by a worker within its 'timeout'" in v2_body["error"]
    assert client.get(f"/v1/requests/{unwatched}")["error_code"] == "timeout"
    assert client.get(f"/v1/requests/{delayed}")["status"] == "queued"
    running = client.get(f"/v1/jobs/{job['id']}")
    assert running["status"] == "running" and running["chunks_done"] == 0, "the worker was not busy all along"

    assert wait_job(client, job["id"])["status"] == "succeeded"
    [result] = collect(client, [delayed]).values()
    assert result["status"] == "succeeded", result
    np.testing.assert_allclose(np.array(result["outputs"]["logits"]), mlp_reference(features(1)), rtol=1e-4,
                               atol=1e-5)

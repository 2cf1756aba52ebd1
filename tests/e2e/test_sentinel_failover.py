"""A real stack on Redis behind Sentinel (a primary, a replica, three Sentinels on loopback) whose primary is
SIGKILLed mid-job: the replica is promoted, and refuses writes (`min-replicas-to-write 1`) until the old primary
is back as its replica. The job succeeds with every row exact and no chunk run twice, and online requests sent
meanwhile get an answer or a retryable 503, never a 500 or a hang."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sits_api.cli.client import ApiClient, ApiError
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_zoo, mlp_reference
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job
from tests.sentinel_group import MASTER_NAME, SentinelGroup

ROWS = 20_000
CHUNK = 500
BATCH = 100
SEQUENCE = 16
REQUEST_SECONDS = 30.0
"""How long an online request may take before the test calls it a hang."""


class OnlineCalls:
    """Waiting mlp requests sent one after the other on a thread, each answer's status counted (a request
    that got no answer within `REQUEST_SECONDS` counts as 'hang')."""

    def __init__(self, stack: Stack) -> None:
        self._client = ApiClient(stack.api_url, stack.api_key, timeout=REQUEST_SECONDS)
        self.statuses: Counter[int | str] = Counter()
        self.wrong: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def _send(self) -> None:
        rng = np.random.default_rng(7)
        while not self._stop.is_set():
            features = rng.standard_normal((1, 64)).astype(np.float32)
            try:
                answer = self._client.post("/v1/requests", {"model": "mlp", "inputs": {"features": features.tolist()},
                                                            "wait": True})
            except ApiError as err:
                self.statuses["hang" if "cannot reach" in err.message else err.http_status] += 1
                if err.http_status == 503 and "cannot reach" not in err.message:
                    time.sleep(0.05)
                continue
            if answer.get("status") == "succeeded":
                self.statuses[200] += 1
                if not np.allclose(answer["outputs"]["logits"], mlp_reference(features), rtol=1e-4, atol=1e-5):
                    self.wrong.append(answer["id"])
            else:
                self.statuses[202] += 1  # queued: not done within its wait

    def __enter__(self) -> OnlineCalls:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(REQUEST_SECONDS + 5)


def _repaired(home: Path) -> int:
    """Chunks the workers acked from parts on disk: an earlier run's ack was lost (`execution.ack_written`)."""
    return sum(path.read_text(errors="replace").count("its parts were on disk already")
               for path in (home / "logs").glob("worker*.log"))


@pytest.mark.slow
def test_a_job_and_online_requests_go_through_a_failover_of_the_redis_primary(tmp_path: Path, zoo_dir: Path) -> None:
    home = tmp_path / "home"
    # as docs/operations.md recommends: a primary without a replica in step refuses writes (503, retried)
    group = SentinelGroup(tmp_path / "redis", min_replicas_to_write=1, min_replicas_max_lag=5).start()
    try:
        settings = stack_settings(home, streams=1, model_roots=(zoo_dir,)).with_overrides(
            redis={"url": group.url, "sentinel_master": MASTER_NAME, "wait_replicas": 1, "wait_timeout": "2s"},
            # leases outlast the failover (a few seconds here): the chunks running through it are not taken back
            scheduler={"lease_timeout": "20s"})
        stack = Stack(settings, worker_count=2, api_port=0).start()
        try:
            client = stack.client()
            register(client, "transformer", zoo_dir / "transformer.onnx")
            register(client, "mlp", build_zoo(home / "models")["mlp"])
            token_ids = np.random.default_rng(5).integers(0, 1000, size=(ROWS, SEQUENCE)).astype(np.int64)
            np.save(home / "token_ids.npy", token_ids)
            job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(home / "token_ids.npy"),
                                           "output_dir": str(home / "out"), "chunk_size": CHUNK,
                                           "batch_size": BATCH})
            with OnlineCalls(stack) as online:
                before = wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= 8)
                old = group.kill_primary()
                killed_at = time.monotonic()
                group.wait_failover(old.port)
                failover_seconds = time.monotonic() - killed_at
                time.sleep(2.0)  # a supervisor restarts the old primary: until then the new one refuses writes
                group.restart(old)  # back, as the new primary's replica
                done = wait_job(client, job["id"], timeout=240)
            print(f"failover {failover_seconds:.1f}s; chunks {done['chunks_total']}, chunk runs {done['chunk_runs']}, "
                  f"acked from parts on disk {_repaired(home)}; online answers {dict(online.statuses)}")
        finally:
            stack.stop()
    finally:
        group.stop()

    assert 0 < before["chunks_done"] < before["chunks_total"], before  # the primary died mid-job
    assert done["status"] == "succeeded", done
    assert done["chunk_runs"] == done["chunks_total"], done  # no chunk ran (and wrote its part) twice
    outputs = np.load(home / "out" / "embedding.npy")
    np.testing.assert_allclose(outputs, direct_run(zoo_dir / "transformer.onnx", token_ids, BATCH), rtol=1e-5,
                               atol=1e-5)
    assert set(online.statuses) <= {200, 202, 503}, online.statuses  # never a 500, nor a hang
    assert online.statuses[200] > 0 and not online.wrong, online.statuses

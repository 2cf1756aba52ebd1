"""Each retry class waits its configured backoff, measured from the job and request records, a bad
input is never retried, and a lost worker's chunks are queued again at once: a real stack (Redis,
API, two Celery workers) whose workers inject the failures (`faults`), so every failure takes the
worker's real error path, and one of them is killed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import FAST_RECOVERY, direct_run, register, stack_settings, wait_job

REAP_INTERVAL = 0.2
"""The test stack's reaper period: a retried item is queued again within one pass of its time."""

RETRY = {
    "run_timeout": {"attempts": 3, "backoff": "0.4s", "backoff_factor": 2},  # 0.4 s, 0.8 s
    "device_oom": {"attempts": 3, "backoff": "0.3s", "backoff_factor": 3},  # 0.3 s, 0.9 s
    "transient": {"attempts": 3, "backoff": "0.5s", "jitter": "0.2s"},  # 0.5 s + up to 0.2 s, twice
}
FAILING_MODELS = {"timeout_mlp": "run_timeout", "oom_mlp": "device_oom", "flaky_mlp": "transient"}
BAD_VALUE = 7.5
RUN_LATENCY = 0.2
"""Added to every run, so that a worker killed during a job surely holds some of its chunks."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("retry-stack") / "home"
    settings = stack_settings(home, streams=2).with_overrides(
        # `fail`: with the default `cpu-offload-on-oom` the OOM model's runs would offload and succeed
        scheduler={**FAST_RECOVERY, "reap_interval": f"{REAP_INTERVAL}s", "fallback_strategy": "fail"}, retry=RETRY,
        faults={"enabled": True, "fail_models": FAILING_MODELS, "fail_values": [BAD_VALUE],
                "run_latency": f"{RUN_LATENCY}s"})
    running = Stack(settings, worker_count=2, api_port=0).start()
    mlp = build_zoo(home / "models")["mlp"]
    for name in ("mlp", *FAILING_MODELS):
        register(running.client(), name, mlp)
    yield running
    running.stop()


def _submit(stack: Stack, model: str, rows: np.ndarray) -> str:
    path = stack.home / f"{model}-in.npy"
    np.save(path, rows)
    job = stack.client().post("/v1/jobs", {"model": model, "input_batch": str(path), "chunk_size": len(rows),
                                           "batch_size": len(rows), "output_dir": str(stack.home / f"{model}-out")})
    return str(job["id"])


def _waits(failures: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(the wait each failure's record asked for, the time until the next failure) of consecutive failures."""
    return [(first["retry_at"] - first["at"], second["at"] - first["at"])
            for first, second in zip(failures, failures[1:], strict=False)]


def test_each_retry_class_waits_its_backoff_and_a_bad_input_is_never_retried(stack: Stack) -> None:
    """One test, so that the worker killed at its end cannot be missing from the others' runs."""
    rows = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    bad = rows.copy()
    bad[5, 3] = BAD_VALUE
    client = stack.client()
    job_ids = {model: _submit(stack, model, rows) for model in FAILING_MODELS}
    job_ids["bad_input"] = _submit(stack, "mlp", bad)
    request = client.post("/v1/requests", {"model": "oom_mlp", "inputs": {"features": rows[:1].tolist()}})
    bad_request = client.post("/v1/requests", {"model": "mlp", "inputs": {"features": bad[5:6].tolist()}})

    done = {name: wait_job(client, job_id, timeout=60) for name, job_id in job_ids.items()}

    for model, failure_class in FAILING_MODELS.items():
        job, policy = done[model], RETRY[failure_class]
        assert job["status"] == "failed" and f"failed 3 times ({failure_class})" in job["error"], job
        assert job["retries"][failure_class]["attempts"] == 3 and set(job["retries"]) == {failure_class}
        assert [entry["class"] for entry in job["failures"]] == [failure_class] * 3
        assert job["failures"][-1]["retry_at"] is None  # the third failure used the class's attempts up
        backoff, factor = float(str(policy["backoff"]).rstrip("s")), float(policy.get("backoff_factor", 1))
        jitter = float(str(policy.get("jitter", "0s")).rstrip("s"))
        for retry, (asked, waited) in enumerate(_waits(job["failures"])):
            expected = backoff * factor ** retry
            assert expected - 1e-3 <= asked <= expected + jitter + 1e-3, (failure_class, job["failures"])
            # it ran again only once its wait was over, and within a reaper pass or so of it
            assert asked - 1e-3 <= waited <= asked + REAP_INTERVAL + RUN_LATENCY + 1.5, (failure_class, job["failures"])

    bad_job = done["bad_input"]
    assert bad_job["status"] == "failed" and "holds 7.5" in bad_job["error"]
    assert set(bad_job["retries"]) == {"bad_input"} and bad_job["retries"]["bad_input"]["attempts"] == 1
    assert len(bad_job["failures"]) == 1 and bad_job["failures"][0]["retry_at"] is None

    deadline = time.monotonic() + 30
    while (result := client.get(f"/v1/requests/{request['id']}"))["status"] == "queued":
        assert time.monotonic() < deadline, result
        time.sleep(0.05)
    assert result["status"] == "failed" and result["error_code"] == "device_out_of_memory", result
    assert result["retries"]["device_oom"]["attempts"] == 3
    assert [round(asked, 3) for asked, _ in _waits(result["failures"])] == [0.3, 0.9], result["failures"]
    while (bad_result := client.get(f"/v1/requests/{bad_request['id']}"))["status"] == "queued":
        assert time.monotonic() < deadline, bad_result
        time.sleep(0.05)
    assert bad_result["status"] == "failed" and bad_result["error_code"] == "bad_input", bad_result
    assert bad_result["retries"]["bad_input"]["attempts"] == 1 and set(bad_result["retries"]) == {"bad_input"}
    assert [entry["retry_at"] for entry in bad_result["failures"]] == [None]

    _a_lost_worker_s_chunks_are_queued_again_at_once(stack)


def _a_lost_worker_s_chunks_are_queued_again_at_once(stack: Stack) -> None:
    from sits_worker.model.zoo import build_zoo

    client = stack.client()
    rows = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)
    path = stack.home / "lost-in.npy"
    np.save(path, rows)
    job_id = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(path), "chunk_size": 4, "batch_size": 4,
                                      "output_dir": str(stack.home / "lost-out")})["id"]
    wait_job(client, job_id, until=lambda job: job["rows_done"] >= 8, timeout=30)
    stack.stop_child("worker0", kill=True)  # it holds chunks: each run takes RUN_LATENCY at least

    done = wait_job(client, job_id, timeout=60)

    assert done["status"] == "succeeded" and done["rows_done"] == len(rows), done
    lost = [entry for entry in done["failures"] if entry["class"] == "worker_lost"]
    # (the record keeps its last 20 failures, lib.lua's FAILURE_LOG_LENGTH: a worker holding run units of
    # several chunks may lose more at once)
    attempts = done["retries"]["worker_lost"]["attempts"]
    assert lost and (attempts == len(lost) or len(lost) == len(done["failures"]) == 20 < attempts), done["failures"]
    assert all(entry["retry_at"] == entry["at"] for entry in lost)  # queued again at once, for any worker
    expected = direct_run(build_zoo(stack.home / "models")["mlp"], rows, 4)
    np.testing.assert_allclose(np.load(stack.home / "lost-out" / "logits.npy"), expected, rtol=1e-5, atol=1e-6)

"""Device OOM through a real stack (Redis, API, a Celery worker on the CPU provider): the worker's
injected OOMs (`faults`) take the real error path. An OOM above a batch size halves the batch until
it fits, and the job's outputs equal a direct ONNX Runtime run; with `cpu-offload-on-oom` an OOM at
every size offloads to the worker's separate CPU session (faults reach only the device's session),
for a job and a merged online batch alike; with `fail` the job fails naming the OOM."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from sits_worker.model.zoo import mlp_reference
from tests.e2e.stack_helpers import FAST_RECOVERY, collect, direct_run, frozen, register, stack_settings, wait_job

OOM_ABOVE_ROWS = 16
FAULTS = {"enabled": True, "oom_above_rows": OOM_ABOVE_ROWS, "fail_models": {"oom_mlp": "device_oom"}}
"""The offload stack's faults: mlp runs above 16 rows run out of memory, oom_mlp's runs all do."""
FAIL_FAULTS = {"enabled": True, "oom_share": 1.0}
"""The `fail` stack's: every run runs out of memory, with the message a real one has."""


def _stack(home: Path, fallback_strategy: str, faults: dict[str, Any], **overrides: Any) -> Stack:
    from sits_worker.model.zoo import build_zoo

    settings = stack_settings(home, streams=2).with_overrides(
        scheduler={**FAST_RECOVERY, "reap_interval": "0.2s", "fallback_strategy": fallback_strategy},
        faults=faults, **overrides)
    running = Stack(settings, worker_count=1, api_port=0)
    try:
        running.start()
    except BaseException:
        running.stop()
        raise
    mlp = build_zoo(home / "models")["mlp"]
    for name in ("mlp", "oom_mlp"):
        register(running.client(), name, mlp)
    return running


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    """Both stacks, started side by side (each start is mostly waiting for its Celery worker)."""
    base = tmp_path_factory.mktemp("oom")
    with ThreadPoolExecutor(2) as pool:
        offload = pool.submit(_stack, base / "offload", "cpu-offload-on-oom", FAULTS)
        fail = pool.submit(_stack, base / "fail", "fail", FAIL_FAULTS,
                           retry={"device_oom": {"attempts": 2, "backoff": "0.1s"}})
        wait([offload, fail])
    running = {name: future.result() for name, future in (("offload", offload), ("fail", fail))
               if future.exception() is None}
    try:
        if len(running) < 2:
            raise next(error for error in (offload.exception(), fail.exception()) if error is not None)
        yield running
    finally:
        for stack in running.values():
            stack.stop()


@pytest.fixture
def offload_stack(stacks: dict[str, Stack]) -> Stack:
    return stacks["offload"]


def _submit(stack: Stack, model: str, rows: np.ndarray, batch_size: int) -> dict[str, Any]:
    path = stack.home / f"{model}-in.npy"
    np.save(path, rows)
    job = stack.client().post("/v1/jobs", {"model": model, "input_batch": str(path), "chunk_size": 256,
                                           "batch_size": batch_size, "output_dir": str(stack.home / f"{model}-out")})
    return wait_job(stack.client(), job["id"], timeout=30)


def _outputs(stack: Stack, done: dict[str, Any]) -> np.ndarray:
    [output] = done["manifest"]["outputs"].values()
    return np.load(stack.home / f"{done['model'].partition('@')[0]}-out" / output["file"])


def _worker_logs(stack: Stack) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted((stack.home / "logs").glob("worker*.log")))


def test_an_oom_above_a_batch_size_halves_the_batch_until_it_fits(offload_stack: Stack) -> None:
    rows = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)

    done = _submit(offload_stack, "mlp", rows, batch_size=100)  # 100 -> 50 -> 25 -> 13 rows fit

    assert done["status"] == "succeeded" and done["rows_done"] == 1000, done
    assert done["retries"] == {}  # settled within the runs: no chunk failed
    logs = _worker_logs(offload_stack)
    assert all(f"running {size} rows of mlp@" in logs for size in (100, 50, 25)), logs[-2000:]
    assert not [line for line in logs.splitlines() if "CPU session" in line and " of mlp@" in line]  # no offload
    expected = direct_run(offload_stack.home / "models" / "mlp.onnx", rows, 100)
    np.testing.assert_allclose(_outputs(offload_stack, done), expected, rtol=1e-5, atol=1e-6)


def test_an_oom_at_every_size_offloads_a_job_to_the_cpu(offload_stack: Stack) -> None:
    rows = np.random.default_rng(1).standard_normal((600, 64)).astype(np.float32)

    done = _submit(offload_stack, "oom_mlp", rows, batch_size=64)

    assert done["status"] == "succeeded" and done["rows_done"] == 600 and done["retries"] == {}, done
    offloads = [line for line in _worker_logs(offload_stack).splitlines() if "CPU session" in line]
    assert any(" of oom_mlp@" in line for line in offloads), offloads
    expected = direct_run(offload_stack.home / "models" / "mlp.onnx", rows, 64)
    np.testing.assert_allclose(_outputs(offload_stack, done), expected, rtol=1e-5, atol=1e-6)


def test_an_oom_at_every_size_offloads_a_merged_online_batch(offload_stack: Stack) -> None:
    client = offload_stack.client()
    rows = np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32)
    with frozen(offload_stack, "worker0"):  # all six wait, then run as one merged batch
        ids = [client.post("/v1/requests", {"model": "oom_mlp", "inputs": {"features": rows[row : row + 1].tolist()}})[
            "id"] for row in range(len(rows))]
    results = [collect(client, ids, timeout=20)[request_id] for request_id in ids]

    assert all(result["status"] == "succeeded" for result in results), results
    assert max(result["batch_size"] for result in results) > 1, results
    np.testing.assert_allclose(np.array([result["outputs"]["logits"][0] for result in results]), mlp_reference(rows),
                               rtol=1e-4, atol=1e-5)


def test_with_fail_an_oom_at_one_row_fails_the_job_naming_the_oom(stacks: dict[str, Stack]) -> None:
    rows = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)

    done = _submit(stacks["fail"], "oom_mlp", rows, batch_size=64)  # 64 -> 32 -> ... -> 1 row, then fails

    assert done["status"] == "failed" and "failed 2 times (device_oom)" in done["error"], done
    assert "device out of memory running a batch of 1 rows" in done["error"], done
    assert done["retries"]["device_oom"]["attempts"] == 2 and set(done["retries"]) == {"device_oom"}

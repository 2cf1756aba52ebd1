"""The chunk size a submitted job gets: its own, the configured one, or (`auto`) one from the model's profile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.jobs import chunking
from broker.models import registry
from broker.queueing import workers
from broker.state.store import Store
from sits_api.app import create_app
from tests.api.api_helpers import Api, error_of

ROWS = 20_000


@pytest.fixture
def big_input(tmp_path: Path) -> Path:
    """20,000 MLP rows: 157 batches of 128, enough to split by time."""
    path = tmp_path / "inputs" / "features.npy"
    path.parent.mkdir()
    np.save(path, np.zeros((ROWS, 64), dtype=np.float32))
    return path


def measure(store: Store, model: dict[str, Any], rows_per_second: float) -> None:
    """Give a registered model a measured profile, as a worker's `sits.profile_model` task would."""
    points = [{"batch_size": batch, "latency_ms": batch / rows_per_second * 1000, "rows_per_second": rows_per_second}
              for batch in (1, 32, 128)]
    registry.update_model_version(store, model["ref"], {"profile": {"device": "cpu", "measured_at": time.time(),
                                                                    "points": points}, "profile_status": "ready"})


def submit(api: Api, input_batch: Path, output_dir: Path, **extra: Any) -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(input_batch),
                                          "output_dir": str(output_dir), "batch_size": 128, **extra})
    assert response.status_code == 201, error_of(response)
    return response.get_json()


def api_with(client_settings: Settings, store: Store, key: str, **jobs: Any) -> Api:
    client: FlaskClient = create_app(client_settings.with_overrides(jobs=jobs), store=store).test_client()
    return Api(client, key)


def test_a_job_without_batch_size_runs_the_best_measured_batch_or_128_without_a_profile(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(big_input),
                                          "output_dir": str(tmp_path / "static")})
    assert response.status_code == 201 and response.get_json()["batch_size"] == 128, error_of(response)

    points = [{"batch_size": size, "latency_ms": 1.0, "rows_per_second": rate}
              for size, rate in ((64, 400_000.0), (256, 900_000.0), (512, 1_000_000.0))]
    registry.update_model_version(store, mlp["ref"], {"profile": {"device": "cpu", "measured_at": time.time(),
                                                                  "points": points}, "profile_status": "ready"})
    for body, expected in (({}, 512), ({"batch_size": "auto"}, 512), ({"batch_size": 32}, 32)):
        response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(big_input),
                                              "output_dir": str(tmp_path / f"out-{expected}-{len(body)}"), **body})
        assert response.status_code == 201, error_of(response)
        assert response.get_json()["batch_size"] == expected, body


def test_a_job_without_chunk_size_gets_about_chunk_seconds_of_the_profiled_rate(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000.0)  # 1 s (jobs.chunk_seconds) is 1,000 rows: 20 chunks

    job = submit(api, big_input, tmp_path / "out")

    assert job["chunk_size"] == 8 * 128  # 157 batches over 20 chunks: 8 batches each
    assert job["chunks_total"] == 20
    assert api.get(f"/v1/jobs/{job['id']}").get_json()["chunk_size"] == 8 * 128


def test_a_faster_model_gets_larger_chunks(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=5_000.0)

    job = submit(api, big_input, tmp_path / "out")

    assert job["chunk_size"] == 40 * 128 and job["chunks_total"] == 4  # 157 batches over 4 chunks


def test_chunk_size_auto_in_the_body_asks_for_the_profile_derived_size(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000.0)

    job = submit(api, big_input, tmp_path / "out", chunk_size="auto")

    assert job["chunk_size"] == 8 * 128


def test_auto_chunks_are_sized_at_the_rate_the_models_chunks_really_ran(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    """Its chunks ran twice as long as its profile says (admission's calibration): half-size chunks, so
    that a chunk still holds its slot about `jobs.chunk_seconds`."""
    measure(store, mlp, rows_per_second=1_000.0)
    store.client.hset(store.keys.admission_calibration, mlp["version"], 2.0)

    job = submit(api, big_input, tmp_path / "out", chunk_size="auto")

    assert job["chunk_size"] == 4 * 128  # 1,000 rows/s at 2x the time: 500 rows in a second, in whole batches


def test_a_job_that_sets_chunk_size_keeps_it(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000.0)

    job = submit(api, big_input, tmp_path / "out", chunk_size=3000)

    assert job["chunk_size"] == 3000 and job["chunks_total"] == 7


def test_a_configured_chunk_size_applies_to_jobs_without_one(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any], big_input: Path,
        tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000.0)
    fixed = api_with(settings, store, admin_key, chunk_size=5000)

    assert submit(fixed, big_input, tmp_path / "out1")["chunk_size"] == 5000
    assert submit(fixed, big_input, tmp_path / "out2", chunk_size="auto")["chunk_size"] == 8 * 128


def test_chunk_seconds_scales_the_auto_size(
        settings: Settings, store: Store, admin_key: str, mlp: dict[str, Any], big_input: Path,
        tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000.0)

    job = submit(api_with(settings, store, admin_key, chunk_seconds="4s"), big_input, tmp_path / "out")

    assert job["chunk_size"] == 32 * 128 and job["chunks_total"] == 5  # 4,000 rows of work: 157 batches / 5


def test_a_short_job_is_split_over_the_live_workers(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000_000.0)  # the whole job is 20 ms of work
    for name in ("w1", "w2", "w3"):
        workers.record_heartbeat(store, name, {"device": "cpu", "streams": 4}, now=time.time())
    workers.record_heartbeat(store, "gone", {"device": "cpu", "streams": 4}, now=time.time() - 60)

    job = submit(api, big_input, tmp_path / "out")

    assert job["chunks_total"] == 12  # one per live stream slot (4 on each of 3 workers), the dead one not counted
    assert job["chunk_size"] == 14 * 128  # 157 batches over 12 chunks


def test_a_gpu_worker_s_streams_share_its_device_and_count_once(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000_000.0)
    for name in ("g1", "g2"):
        workers.record_heartbeat(store, name, {"device": "gpu:0", "streams": 4}, now=time.time())

    job = submit(api, big_input, tmp_path / "out")

    assert job["chunks_total"] == 4  # two per worker, not one per stream


def test_resume_keeps_the_job_s_original_chunk_size(
        api: Api, store: Store, mlp: dict[str, Any], big_input: Path, tmp_path: Path) -> None:
    measure(store, mlp, rows_per_second=1_000.0)
    job = submit(api, big_input, tmp_path / "out")
    api.delete(f"/v1/jobs/{job['id']}")
    measure(store, mlp, rows_per_second=50_000.0)  # a new profile must not re-cut a job's chunks

    resumed = api.post(f"/v1/jobs/{job['id']}/resume")

    assert resumed.status_code == 202, error_of(resumed)
    assert resumed.get_json()["chunk_size"] == job["chunk_size"]
    assert resumed.get_json()["chunks_total"] == job["chunks_total"]
    ready = api.get("/v1/status").get_json()["queues"][mlp["ref"]]["ready"]
    assert ready == job["chunks_total"]


@pytest.mark.parametrize("value", [0, "big", -5])
def test_a_chunk_size_that_is_neither_rows_nor_auto_answers_400(
        api: Api, mlp: dict[str, Any], big_input: Path, tmp_path: Path, value: Any) -> None:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(big_input),
                                          "output_dir": str(tmp_path / "out"), "chunk_size": value})

    assert response.status_code == 400
    assert "chunk_size" in error_of(response)


def test_a_chunk_size_that_makes_more_than_max_chunks_per_job_answers_400_with_the_least_size(
        api: Api, mlp: dict[str, Any], big_input: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunking, "MAX_CHUNKS_PER_JOB", 10)  # (100,000 chunks of real rows take seconds)
    rows = len(np.load(big_input, mmap_mode="r"))
    least = -(-rows // 10)

    too_many = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(big_input),
                                          "output_dir": str(tmp_path / "out"), "chunk_size": least - 1})
    enough = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(big_input),
                                        "output_dir": str(tmp_path / "out"), "chunk_size": least})

    assert too_many.status_code == 400
    assert error_of(too_many) == (f"chunk_size {least - 1:,} cuts {rows:,} rows into 11 chunks; a job has at most 10: "
                                  f"give chunk_size {least:,} or more, or 'auto' to let the server size them")
    assert enough.status_code == 201 and enough.get_json()["chunks_total"] == 10

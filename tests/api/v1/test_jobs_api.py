"""POST/GET/DELETE /v1/jobs and resume: submitting offline jobs, steering them, and every way a job is refused."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from flask.testing import FlaskClient

from broker.config.settings import Settings
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.app import create_app
from sits_worker.serving import outputs
from tests.api.api_helpers import Api, error_of, make_settings, queued_items
from tests.leasing import lease_items

JOB_FIELDS = {"id", "model", "status", "rows_total", "rows_done", "chunks_total", "chunks_done", "output_dir",
              "error"}


def submit(api: Api, **body: Any) -> Any:
    return api.post("/v1/jobs", json=body)


def job_body(model: str, input_batch: Path, output_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"model": model, "input_batch": str(input_batch), "output_dir": str(output_dir), **extra}


def ready_count(api: Api, model: dict[str, Any]) -> int:
    return api.get("/v1/status").get_json()["queues"][model["ref"]]["ready"]


# --- the happy path -----------------------------------------------------------------------


def test_a_valid_job_answers_201_queued_with_its_chunks(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", chunk_size=4, batch_size=2))

    assert response.status_code == 201, error_of(response)
    job = response.get_json()
    assert JOB_FIELDS <= set(job)
    assert job["id"].startswith("j")
    assert job["status"] == "queued"
    assert job["model"] == "mlp" and job["model_version"] == mlp["version"]
    assert job["rows_total"] == 10 and job["rows_done"] == 0
    assert job["chunks_total"] == 3 and job["chunks_done"] == 0  # rows 0-3, 4-7, 8-9
    assert job["chunk_size"] == 4 and job["batch_size"] == 2
    assert job["output_dir"] == str((tmp_path / "out").resolve())
    assert job["output_names"] == ["logits"]
    assert job["error"] is None
    assert job["owner"] == "test"
    assert (tmp_path / "out").is_dir()
    assert ready_count(api, mlp) == 3


def test_chunk_size_defaults_to_4096_rows_for_a_model_without_a_measured_profile(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out")).get_json()

    assert job["chunk_size"] == 4096 and job["chunks_total"] == 1  # jobs.chunk_size: auto (test_chunk_size.py)


def test_a_job_can_pin_a_model_version(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body(mlp["ref"], mlp_input, tmp_path / "out"))

    assert response.status_code == 201, error_of(response)
    assert response.get_json()["model_ref"] == mlp["ref"]


def test_submitting_a_job_publishes_a_drain_task_to_celery(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path, redis_server: EmbeddedRedis,
        settings: Settings) -> None:
    broker = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = settings.redis.task_queue  # this deployment's: its key prefix
    before = broker.llen(queue)

    submit(api, **job_body("mlp", mlp_input, tmp_path / "out"))

    assert queue == settings.redis.key_prefix and broker.llen(queue) == before + 1
    message = json.loads(broker.lindex(queue, 0))  # kombu LPUSHes, workers BRPOP
    assert message["headers"]["task"] == "sits.drain"
    broker.close()


def test_a_job_reads_back_with_its_progress_fields(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    submitted = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", chunk_size=5)).get_json()

    response = api.get(f"/v1/jobs/{submitted['id']}")

    assert response.status_code == 200
    job = response.get_json()
    assert {field: job[field] for field in JOB_FIELDS} == {
        "id": submitted["id"], "model": "mlp", "status": "queued", "rows_total": 10, "rows_done": 0,
        "chunks_total": 2, "chunks_done": 0, "output_dir": str((tmp_path / "out").resolve()), "error": None}
    assert job["progress"] == 0.0 and job["eta_seconds"] is None


def test_listing_jobs_shows_the_newest_first_and_filters_by_status(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    first = submit(api, **job_body("mlp", mlp_input, tmp_path / "out1")).get_json()
    second = submit(api, **job_body("mlp", mlp_input, tmp_path / "out2")).get_json()
    api.delete(f"/v1/jobs/{first['id']}")

    listed = api.get("/v1/jobs")
    queued = api.get("/v1/jobs?status=queued")
    limited = api.get("/v1/jobs?limit=1")

    assert listed.status_code == 200
    assert [job["id"] for job in listed.get_json()["jobs"]] == [second["id"], first["id"]]
    assert [job["id"] for job in queued.get_json()["jobs"]] == [second["id"]]
    assert len(limited.get_json()["jobs"]) == 1


def test_a_non_integer_limit_answers_400(api: Api) -> None:
    response = api.get("/v1/jobs?limit=many")

    assert response.status_code == 400
    assert "limit must be a whole number from 1 to" in error_of(response)


def test_a_negative_limit_answers_400(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    submit(api, **job_body("mlp", mlp_input, tmp_path / "out"))

    response = api.get("/v1/jobs?limit=-1")

    assert response.status_code == 400, response.get_json()
    assert "limit" in error_of(response)


def test_cancelling_a_job_marks_it_cancelled_and_empties_its_queue(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", chunk_size=4)).get_json()

    response = api.delete(f"/v1/jobs/{job['id']}")

    assert response.status_code == 200
    assert response.get_json()["status"] == "cancelled"
    assert response.get_json()["error"] == "cancelled by the user"
    assert api.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "cancelled"
    assert ready_count(api, mlp) == 0


def test_resuming_a_cancelled_job_requeues_its_chunks(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", chunk_size=4)).get_json()
    api.delete(f"/v1/jobs/{job['id']}")

    response = api.post(f"/v1/jobs/{job['id']}/resume")

    assert response.status_code == 202, error_of(response)
    assert response.get_json()["status"] == "queued"
    assert response.get_json()["error"] is None
    assert ready_count(api, mlp) == 3


def test_resuming_a_job_whose_parts_were_deleted_runs_those_chunks_again(
        api: Api, store: Store, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """Its merge would otherwise fail for ever: "part ... is missing; run that chunk again"."""
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", chunk_size=4)).get_json()  # rows 0-4-8-10
    for item in lease_items(store, mlp["ref"], now=time.time(), lease_seconds=30, max_items=2):
        outputs.write_part(tmp_path / "out", item.payload["chunk"], {"logits": np.zeros((4, 10), np.float32)},
                           job_id=job["id"])
        job_progress.ack_chunk(store, item, now=time.time(), worker="w1")
    api.delete(f"/v1/jobs/{job['id']}")
    stopped = api.get(f"/v1/jobs/{job['id']}").get_json()
    assert (stopped["chunks_done"], stopped["rows_done"]) == (2, 8)
    for part in (tmp_path / "out" / ".parts" / job["id"]).glob("*.000000.npy"):  # chunk 0's parts are lost
        part.unlink()

    response = api.post(f"/v1/jobs/{job['id']}/resume")

    assert response.status_code == 202, error_of(response)
    assert (response.get_json()["chunks_done"], response.get_json()["rows_done"]) == (1, 4)
    assert sorted(store.client.zrange(store.keys.ready(mlp["ref"]), 0, -1)) == [
        jobs.chunk_item_id(job["id"], 0), jobs.chunk_item_id(job["id"], 2)]


def test_resuming_a_job_whose_input_changed_answers_400_saying_to_resubmit(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out")).get_json()
    api.delete(f"/v1/jobs/{job['id']}")
    np.save(mlp_input, np.ones((10, 64), dtype=np.float32))

    response = api.post(f"/v1/jobs/{job['id']}/resume")

    assert response.status_code == 400
    message = error_of(response)
    assert "changed since the job was submitted" in message and "submit a new job" in message


def test_resuming_a_job_whose_input_was_deleted_answers_404_naming_the_file(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out")).get_json()
    api.delete(f"/v1/jobs/{job['id']}")
    mlp_input.unlink()

    response = api.post(f"/v1/jobs/{job['id']}/resume")

    assert response.status_code == 404
    assert str(mlp_input) in error_of(response)


@pytest.mark.parametrize("method, path", [("get", "/v1/jobs/jnope"), ("delete", "/v1/jobs/jnope"),
                                          ("post", "/v1/jobs/jnope/resume")])
def test_an_unknown_job_answers_404_naming_the_id(api: Api, method: str, path: str) -> None:
    response = getattr(api, method)(path)

    assert response.status_code == 404
    assert "'jnope'" in error_of(response)


# --- refusals: the input -----------------------------------------------------------------------


def test_a_float64_input_for_a_float32_model_answers_400_naming_input_and_dtype(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "features64.npy"
    np.save(path, np.zeros((10, 64), dtype=np.float64))

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    message = error_of(response)
    assert "'features'" in message and "float32 [N,64]" in message and "float64 [10,64]" in message
    assert "astype(np.float32)" in message


def test_a_wrong_per_sample_shape_answers_400_naming_the_expected_row_shape(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "narrow.npy"
    np.save(path, np.zeros((10, 32), dtype=np.float32))

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    message = error_of(response)
    assert "'features'" in message and "[N,64]" in message and "[10,32]" in message
    assert "each row must have shape [64]" in message


def test_an_input_with_no_rows_answers_400(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "empty.npy"
    np.save(path, np.zeros((0, 64), dtype=np.float32))

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    assert "no rows" in error_of(response)


def test_an_unknown_model_answers_404_listing_the_registered_ones(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body("resnet", mlp_input, tmp_path / "out"))

    assert response.status_code == 404
    message = error_of(response)
    assert "'resnet'" in message and "registered models: mlp" in message


def test_an_unknown_model_version_answers_404_naming_it(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body("mlp@ffffffffffff", mlp_input, tmp_path / "out"))

    assert response.status_code == 404
    assert "mlp@ffffffffffff" in error_of(response)


def test_a_missing_input_file_answers_404_naming_it(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    response = submit(api, **job_body("mlp", tmp_path / "nowhere.npy", tmp_path / "out"))

    assert response.status_code == 404
    assert "nowhere.npy" in error_of(response) and "does not exist" in error_of(response)


def test_a_folder_named_like_an_input_answers_400(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "folder.npy").mkdir()

    response = submit(api, **job_body("mlp", tmp_path / "folder.npy", tmp_path / "out"))

    assert response.status_code == 400
    assert "regular file" in error_of(response)


def test_an_input_outside_the_input_roots_answers_403_naming_the_roots(
        api: Api, mlp: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("not-an-input-root") / "features.npy"
    np.save(outside, np.zeros((10, 64), dtype=np.float32))

    response = submit(api, **job_body("mlp", outside, tmp_path / "out"))

    assert response.status_code == 403
    message = error_of(response)
    assert str(outside) in message and str(tmp_path.resolve()) in message and "paths.input_roots" in message


def test_an_input_symlink_escaping_the_roots_answers_403(
        api: Api, mlp: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("not-an-input-root") / "features.npy"
    np.save(outside, np.zeros((10, 64), dtype=np.float32))
    (tmp_path / "link.npy").symlink_to(outside)

    response = submit(api, **job_body("mlp", tmp_path / "link.npy", tmp_path / "out"))

    assert response.status_code == 403
    assert "symbolic link" in error_of(response) and "input roots" in error_of(response)
    assert str(outside) not in error_of(response)  # where a link leads is not told (another tenant's folder)


def test_an_output_dir_outside_the_output_roots_answers_403_naming_the_roots(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("not-an-output-root") / "out"

    response = submit(api, **job_body("mlp", mlp_input, outside))

    assert response.status_code == 403
    message = error_of(response)
    assert str(outside) in message and "paths.output_roots" in message
    assert not outside.exists()


@pytest.mark.parametrize("field, value, status", [("input_batch", "{root}/x\u0000.npy", 400),
                                                  ("output_dir", "~no_such_user_sits/out", 403),
                                                  ("output_dir", "~root/out", 403)],
                         ids=["nul-byte-input", "unknown-home-output", "a-home-output"])
def test_an_unresolvable_job_path_answers_4xx_not_500_and_tells_nothing_of_the_host(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path, field: str, value: str, status: int) -> None:
    """`~` is not expanded: a home folder is no root, and which users exist is none of a client's business."""
    body = job_body("mlp", mlp_input, tmp_path / "out") | {field: value.format(root=tmp_path)}

    response = submit(api, **body)

    assert response.status_code == status, error_of(response)
    assert field.split("_")[0] in error_of(response) and "/root/" not in error_of(response)


def test_an_output_dir_that_is_a_file_answers_400(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    (tmp_path / "out.txt").write_text("not a folder")

    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out.txt"))

    assert response.status_code == 400
    assert "is a file; name a folder" in error_of(response)


def test_an_output_dir_below_a_file_answers_400_not_500(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    (tmp_path / "out.txt").write_text("not a folder")

    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out.txt" / "sub"))

    assert response.status_code == 400, error_of(response)
    assert "out.txt" in error_of(response)


def test_an_npz_missing_an_input_answers_400_naming_the_needed_array(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "wrong.npz"
    np.savez(path, pixels=np.zeros((10, 64), dtype=np.float32))

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    message = error_of(response)
    assert "['pixels']" in message and "['features']" in message and "np.savez(path, features=...)" in message


def test_an_npz_keyed_by_input_name_is_accepted(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "good.npz"
    np.savez_compressed(path, features=np.zeros((7, 64), dtype=np.float32))

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 201, error_of(response)
    assert response.get_json()["rows_total"] == 7 and response.get_json()["input_format"] == "npz"


@pytest.mark.parametrize("suffix", [".xlsx", ".h5", ""])
def test_an_unsupported_input_format_answers_400_listing_the_supported_ones(
        api: Api, mlp: dict[str, Any], tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"features{suffix}"
    path.write_text("1,2,3\n")

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    message = error_of(response)
    assert "unsupported format" in message and ".npy, .npz, .bin, .jsonl" in message


def test_a_file_that_is_not_npy_despite_its_suffix_answers_400(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "fake.npy"
    path.write_bytes(b"not numpy at all")

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    assert "np.save" in error_of(response)


def test_shape_and_dtype_for_a_non_bin_input_answer_400(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", input_shape=[64], input_dtype="float32"))

    assert response.status_code == 400
    assert "only to raw .bin" in error_of(response)


def test_a_raw_bin_input_of_whole_rows_is_accepted(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "features.bin"
    np.zeros((6, 64), dtype="<f4").tofile(path)

    response = submit(api, **job_body("mlp", path, tmp_path / "out", input_dtype="float32"))

    assert response.status_code == 201, error_of(response)
    assert response.get_json()["rows_total"] == 6


def test_a_raw_bin_input_that_is_not_whole_rows_answers_400(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "features.bin"
    path.write_bytes(b"\0" * (64 * 4 + 3))

    response = submit(api, **job_body("mlp", path, tmp_path / "out"))

    assert response.status_code == 400
    assert "not a multiple of one float32 row of shape [64]" in error_of(response)


def test_a_raw_bin_input_for_a_dynamic_model_without_a_shape_answers_400(
        api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    assert api.post("/v1/models", json={"name": "tf", "path": str(zoo_dir / "transformer.onnx")}).status_code == 201
    path = tmp_path / "ids.bin"
    np.zeros((4, 16), dtype="<i8").tofile(path)

    response = submit(api, **job_body("tf", path, tmp_path / "out"))

    assert response.status_code == 400
    assert "'input_ids'" in error_of(response) and "pass the per-row shape" in error_of(response)


def test_an_empty_raw_bin_with_a_shape_too_large_for_numpy_answers_400_not_500(
        api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    assert api.post("/v1/models", json={"name": "tf", "path": str(zoo_dir / "transformer.onnx")}).status_code == 201
    path = tmp_path / "ids.bin"
    path.write_bytes(b"")

    response = submit(api, **job_body("tf", path, tmp_path / "out", input_shape=[10**20]))

    assert response.status_code == 400, error_of(response)


def test_a_jsonl_input_for_a_token_model_is_accepted(api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    assert api.post("/v1/models", json={"name": "tf", "path": str(zoo_dir / "transformer.onnx")}).status_code == 201
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(n))}) + "\n" for n in (3, 5, 3)))

    response = submit(api, **job_body("tf", path, tmp_path / "out"))

    assert response.status_code == 201, error_of(response)
    assert response.get_json()["rows_total"] == 3


def test_a_jsonl_row_with_floats_for_int64_ids_answers_400(api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    assert api.post("/v1/models", json={"name": "tf", "path": str(zoo_dir / "transformer.onnx")}).status_code == 201
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": [1.5, 2.0]}) + "\n")

    response = submit(api, **job_body("tf", path, tmp_path / "out"))

    assert response.status_code == 400
    assert "'input_ids'" in error_of(response) and "int64" in error_of(response)


def test_a_deeply_nested_jsonl_row_answers_400_not_500(api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    assert api.post("/v1/models", json={"name": "tf", "path": str(zoo_dir / "transformer.onnx")}).status_code == 201
    path = tmp_path / "deep.jsonl"
    path.write_text('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")

    response = submit(api, **job_body("tf", path, tmp_path / "out"))

    assert response.status_code == 400, error_of(response)


# --- refusals: the body -----------------------------------------------------------------------


@pytest.mark.parametrize("priority", [16, -1])
def test_a_priority_outside_0_to_15_answers_400_naming_the_bound(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path, priority: int) -> None:
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", priority=priority))

    assert response.status_code == 400
    message = error_of(response)
    assert message.startswith("invalid JobSubmission: priority:")
    assert ("15" if priority > 15 else "0") in message


def test_a_zero_chunk_size_answers_400(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", chunk_size=0))

    assert response.status_code == 400
    assert "chunk_size" in error_of(response)


def test_an_unknown_field_answers_400_naming_it(api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out", priorty=3))

    assert response.status_code == 400
    assert "priorty: unknown field" in error_of(response)


def test_missing_fields_answer_400_naming_each(api: Api) -> None:
    response = submit(api, model="mlp")

    assert response.status_code == 400
    message = error_of(response)
    assert "input_batch: Field required" in message and "output_dir: Field required" in message


@pytest.mark.parametrize("data, content_type", [
    ("model=mlp", "application/x-www-form-urlencoded"),
    ("{not json", "application/json"),
    ("[1, 2, 3]", "application/json"),
    ("", "application/json"),
])
def test_a_body_that_is_not_a_json_object_answers_400(api: Api, data: str, content_type: str) -> None:
    response = api.post("/v1/jobs", data=data, content_type=content_type)

    assert response.status_code == 400
    assert "must be a JSON object" in error_of(response)


def test_refused_jobs_leave_nothing_queued(api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    wrong = tmp_path / "features64.npy"
    np.save(wrong, np.zeros((10, 64), dtype=np.float64))
    submit(api, **job_body("mlp", wrong, tmp_path / "out"))
    submit(api, **job_body("mlp", tmp_path / "missing.npy", tmp_path / "out"))

    assert api.get("/v1/jobs").get_json()["jobs"] == []
    assert api.get("/v1/status").get_json()["queues"] == {}


# --- body size -----------------------------------------------------------------------------


@pytest.fixture
def small_body_client(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> FlaskClient:
    settings = make_settings(redis_server, store, tmp_path, zoo_dir, max_body_bytes="512B")
    return create_app(settings, store=store).test_client()


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/models"])
def test_an_oversized_body_answers_413_naming_the_limit(
        small_body_client: FlaskClient, store: Store, tmp_path: Path, path: str) -> None:
    key = create_api_key(store, "test", "admin")
    body = job_body("mlp", tmp_path / ("x" * 1000 + ".npy"), tmp_path / "out")

    response = small_body_client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})

    assert response.status_code == 413
    message = error_of(response)
    assert "512-byte limit" in message and "api.max_body_bytes" in message
    assert response.get_json()["code"] == "payload_too_large"


def test_a_body_under_the_limit_is_still_read(
        small_body_client: FlaskClient, store: Store, zoo_dir: Path) -> None:
    key = create_api_key(store, "test", "admin")

    response = small_body_client.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")},
                                      headers={"Authorization": f"Bearer {key}"})

    assert response.status_code == 201, error_of(response)


def test_an_output_dir_in_use_by_an_active_job_answers_409(
    api: Api, mlp: dict, mlp_input: Path, tmp_path: Path
) -> None:
    body = {"model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "shared-out")}
    first = api.post("/v1/jobs", json=body)
    assert first.status_code == 201
    second = api.post("/v1/jobs", json=body)
    assert second.status_code == 409
    assert first.get_json()["id"] in error_of(second) and "another folder" in error_of(second)
    api.delete(f"/v1/jobs/{first.get_json()['id']}")
    assert api.post("/v1/jobs", json=body).status_code == 201


def test_a_second_job_into_the_folder_of_an_active_one_answers_409_and_a_finished_one_s_too(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """The folder is claimed atomically when a job is created, so two jobs never both run into it
    (each would run every row, and all but one fail at their merge)."""
    first = submit(api, **job_body("mlp", mlp_input, tmp_path / "out")).get_json()
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "out"))
    assert response.status_code == 409 and f"in use by job {first['id']}" in error_of(response)

    api.delete(f"/v1/jobs/{first['id']}")  # no longer active: the folder is free to take
    second = submit(api, **job_body("mlp", mlp_input, tmp_path / "out"))
    assert second.status_code == 201, error_of(second)
    resumed = api.post(f"/v1/jobs/{first['id']}/resume")  # the second holds it now
    assert resumed.status_code == 409 and "in use by job" in error_of(resumed)

    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "manifest.json").write_text("{}")
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "done"))
    assert response.status_code == 409 and "already holds the results of a finished job" in error_of(response)


def test_a_folder_holding_files_the_outputs_would_replace_answers_409_and_keeps_them(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    """Files no job's manifest accounts for are someone's data (another tenant's, or the job's own
    input): a merge would have replaced them without a word."""
    data = tmp_path / "data"
    data.mkdir()
    mine = np.arange(6, dtype=np.float32)
    np.save(data / "logits.npy", mine)  # named as the MLP's output 'logits'

    response = submit(api, **job_body("mlp", mlp_input, data))

    assert response.status_code == 409
    assert error_of(response) == (f"output_dir {data} already holds logits.npy (output 'logits'), which this job's "
                                  "outputs would replace; choose another folder or move those files away")
    assert queued_items(api) == 0 and np.array_equal(np.load(data / "logits.npy"), mine)
    np.save(data / "other.npy", mine)  # files of other names are no obstacle
    (data / "logits.npy").unlink()
    assert submit(api, **job_body("mlp", mlp_input, data)).status_code == 201


def test_a_job_records_its_input_s_identity_and_a_resume_after_an_identical_rewrite_refreshes_it(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out")).get_json()
    recorded = api.get(f"/v1/jobs/{job['id']}").get_json()["input_stat"]
    assert recorded["size"] == mlp_input.stat().st_size
    api.delete(f"/v1/jobs/{job['id']}")
    mlp_input.write_bytes(mlp_input.read_bytes())  # the same bytes, a new modification time
    os.utime(mlp_input, ns=(recorded["mtime_ns"] + 10**9, recorded["mtime_ns"] + 10**9))

    assert api.post(f"/v1/jobs/{job['id']}/resume").status_code == 202
    assert api.get(f"/v1/jobs/{job['id']}").get_json()["input_stat"]["mtime_ns"] == recorded["mtime_ns"] + 10**9


def test_of_jobs_racing_for_one_folder_only_the_last_to_claim_it_stays(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path, store: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim held by a job not created yet is free to take: here another submit claims the folder
    between this one's claim and its job's creation. This job, created, finds it lost the folder:
    it is stopped and the answer is 409; the other keeps it."""
    from broker.jobs import fills as job_fills
    from broker.jobs import output_dirs

    out = str((tmp_path / "shared").resolve())
    create_job = job_fills.create_job

    def another_claims_first(store_: Any, spec: Any, **kwargs: Any) -> None:
        output_dirs.claim_output_dir(store_, out, "job-claiming-meanwhile", caller={"name": "test", "role": "admin"})
        create_job(store_, spec, **kwargs)

    monkeypatch.setattr(job_fills, "create_job", another_claims_first)
    response = submit(api, **job_body("mlp", mlp_input, tmp_path / "shared"))

    assert response.status_code == 409 and "claimed by another job at the same time" in error_of(response)
    assert output_dirs.holds_output_dir(store, out, "job-claiming-meanwhile")
    [stopped] = api.get("/v1/jobs").get_json()["jobs"]
    assert stopped["status"] == "failed" and ready_count(api, mlp) == 0


def test_resuming_into_a_folder_that_now_holds_another_job_s_results_answers_409(
        api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    job = submit(api, **job_body("mlp", mlp_input, tmp_path / "out")).get_json()
    api.delete(f"/v1/jobs/{job['id']}")
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"job": "another-job"}))

    response = api.post(f"/v1/jobs/{job['id']}/resume")

    assert response.status_code == 409 and "now holds the results of job another-job" in error_of(response)

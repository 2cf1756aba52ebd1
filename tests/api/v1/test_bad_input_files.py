"""Lying or malformed inputs, through the API: each answers 400 naming what to fix, and nothing is queued.

The decoders themselves are tested in tests/worker/model/test_bad_inputs.py; this checks that their refusals
reach the client as 400s from POST /v1/jobs and POST /v1/requests, before any job, chunk or request
is written to Redis.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from werkzeug.test import TestResponse

from tests.api.api_helpers import Api, error_of
from tests.npy_files import float32_header, npy_bytes, write_npz

HUGE_SHAPE = "(100000000000, 64)"
MALFORMED_HEADER = "{'descr': 'zz', 'fortran_order': False, 'shape': ("  # numpy's parser raises TokenError


def submit_job(api: Api, input_batch: Path, tmp_path: Path) -> TestResponse:
    return api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(input_batch),
                                      "output_dir": str(tmp_path / "out")})


def submit_request(api: Api, features: Any) -> TestResponse:
    return api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": features}})


def assert_job_refused(api: Api, input_batch: Path, tmp_path: Path, phrase: str) -> None:
    """A job of `input_batch` answers 400 with `phrase` in its message, and nothing is queued."""
    response = submit_job(api, input_batch, tmp_path)
    assert response.status_code == 400, response.get_json()
    assert phrase in error_of(response)
    assert_nothing_queued(api)


def assert_nothing_queued(api: Api) -> None:
    assert api.get("/v1/jobs").get_json()["jobs"] == []
    assert api.get("/v1/status").get_json()["queues"] == {}


# --- 1: a compressed npz whose header claims more rows than it holds --------------------------


def test_an_npz_member_claiming_a_huge_shape_answers_400_and_queues_no_job_or_chunk(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = write_npz(tmp_path / "lie.npz", npy_bytes(float32_header(HUGE_SHAPE), bytes(256)))

    response = submit_job(api, path, tmp_path)

    assert response.status_code == 400, response.get_json()
    message = error_of(response)
    assert "array 'features' in 'lie.npz'" in message and "[100000000000, 64]" in message
    assert "256 bytes of data follow" in message
    assert_nothing_queued(api)


# --- 2: malformed npy headers ------------------------------------------------------------------


def test_a_malformed_npy_header_in_a_job_input_answers_400_naming_the_file(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(npy_bytes(MALFORMED_HEADER, bytes(256)))

    assert_job_refused(api, path, tmp_path, "'bad.npy' has a malformed .npy header")


def test_a_malformed_npy_header_in_an_npz_member_answers_400_naming_the_array(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = write_npz(tmp_path / "bad.npz", npy_bytes(MALFORMED_HEADER, bytes(256)))

    assert_job_refused(api, path, tmp_path, "array 'features' in 'bad.npz' has a malformed .npy header")


def test_a_malformed_npy_header_in_a_b64_request_input_answers_400_naming_the_input(
        api: Api, mlp: dict[str, Any]) -> None:
    encoded = base64.b64encode(npy_bytes(MALFORMED_HEADER, bytes(256))).decode()

    response = submit_request(api, {"b64": encoded})

    assert response.status_code == 400, response.get_json()
    assert "input 'features' has a malformed .npy header" in error_of(response)
    assert_nothing_queued(api)


# --- 3: a b64 npy claiming a huge shape with no data ---------------------------------------------


def test_a_b64_input_claiming_a_huge_shape_without_data_answers_400(api: Api, mlp: dict[str, Any]) -> None:
    encoded = base64.b64encode(npy_bytes(float32_header(HUGE_SHAPE))).decode()

    response = submit_request(api, {"b64": encoded})

    assert response.status_code == 400, response.get_json()
    message = error_of(response)
    assert "input 'features'" in message and "[100000000000, 64]" in message and "0 bytes of data" in message
    assert_nothing_queued(api)


# --- 4: JSON numbers that are not finite or overflow float32 ------------------------------------


def test_a_json_number_overflowing_float32_answers_400_naming_input_and_dtype(
        api: Api, mlp: dict[str, Any]) -> None:
    response = submit_request(api, [[0.5] * 63 + [1e308]])

    assert response.status_code == 400, response.get_json()
    assert "input 'features' holds a value that is not finite or does not fit float32" in error_of(response)
    assert_nothing_queued(api)


@pytest.mark.parametrize("literal, phrase", [
    ("NaN", "NaN is not a JSON number"), ("Infinity", "Infinity is not a JSON number"),
    ("-Infinity", "-Infinity is not a JSON number"), ("1e400", "1e400 is beyond the range of a 64-bit float"),
    ("3.5e38", "is not finite or does not fit float32"),
])
def test_non_finite_json_literals_answer_400(api: Api, mlp: dict[str, Any], literal: str, phrase: str) -> None:
    row = ", ".join(["0.5"] * 63 + [literal])
    body = '{"model": "mlp", "inputs": {"features": [[' + row + "]]}}"

    response = api.post("/v1/requests", data=body, content_type="application/json")

    assert response.status_code == 400, response.get_json()
    assert phrase in error_of(response)  # the parser refuses what no double holds, the tensor check the rest
    assert_nothing_queued(api)


def test_a_jsonl_row_holding_a_number_float32_cannot_hold_answers_400_naming_its_line(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    """(NaN stays as written in a file, as in a .npy: tests/worker/model/test_bad_inputs.py.)"""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n" + json.dumps({"features": [0.5] * 63 + [1e39]}) + "\n")

    assert_job_refused(api, path, tmp_path, "does not fit float32 in row 0 of 'rows.jsonl' (line 2)")


# --- 5: jsonl messages name the file's line ------------------------------------------------------


def test_a_bad_first_jsonl_row_answers_400_naming_its_1_based_line(
        api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n\n{not json\n" + json.dumps({"features": [0.5] * 64}) + "\n")

    assert_job_refused(api, path, tmp_path, "invalid JSON in row 0 of 'rows.jsonl' (line 3)")


def test_a_token_job_s_first_row_is_checked_at_submit_like_a_request(
        api: Api, tmp_path: Path, zoo_dir: Path) -> None:
    """A negative token id, a mask of 2, a sequence over the model's declared sits.max_sequence: 400
    before anything is queued (later rows are checked when a worker reads them)."""
    response = api.post("/v1/models", json={"name": "transformer", "path": str(zoo_dir / "transformer.onnx")})
    assert response.status_code == 201, response.get_json()
    ids = np.ones((3, 16), dtype=np.int64)
    cases = {"negative.npz": ({"input_ids": np.where(ids == 1, -1, ids)}, "negative token id"),
             "mask.npz": ({"input_ids": ids, "attention_mask": np.full_like(ids, 2)}, "other than 0 and 1"),
             "long.npz": ({"input_ids": np.ones((2, 600), dtype=np.int64)}, "sits.max_sequence = 512")}
    for name, (arrays, reason) in cases.items():
        np.savez(tmp_path / name, **arrays)
        response = api.post("/v1/jobs", json={"model": "transformer", "input_batch": str(tmp_path / name),
                                              "output_dir": str(tmp_path / f"out-{name}")})
        assert response.status_code == 400 and reason in error_of(response), (name, response.get_json())
    assert_nothing_queued(api)

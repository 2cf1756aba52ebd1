"""Scheduling fields of `POST /v1/requests` that the scheduler trusts are checked against the input.

`tokens` decides the express lane (requests under `express_max_tokens` are served first) and the
estimated latency, so a count that does not match the input is refused rather than believed; a
model's declared `sits.max_sequence` bounds a request's sequence before anything is queued.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from broker.state.store import Store
from sits_worker.model.zoo import TRANSFORMER_MAX_SEQUENCE, TRANSFORMER_VOCAB
from tests.api.api_helpers import Api, error_of
from tests.onnx_models import int_series_model, token_model


@pytest.fixture
def transformer(api: Api, zoo_dir: Path) -> dict[str, Any]:
    response = api.post("/v1/models", json={"name": "transformer", "path": str(zoo_dir / "transformer.onnx")})
    assert response.status_code == 201, response.get_json()
    return response.get_json()


def ids(length: int, rows: int = 1) -> list[list[int]]:
    return [[1 + (i % 50) for i in range(length)] for _ in range(rows)]


def submit(api: Api, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = api.post("/v1/requests", json=body)
    return response.status_code, response.get_json()


def test_a_token_count_that_does_not_match_the_input_is_refused(api: Api, transformer: dict[str, Any]) -> None:
    status, body = submit(api, {"model": "transformer", "inputs": {"input_ids": ids(300)}, "tokens": 1})
    assert status == 400 and "'tokens' is 1 but the input holds 300 tokens" in body["error"]

    status, _ = submit(api, {"model": "transformer", "inputs": {"input_ids": ids(30, rows=2)}, "tokens": 60})
    assert status == 202
    status, _ = submit(api, {"model": "transformer", "inputs": {"input_ids": ids(30, rows=2)}})
    assert status == 202  # counted by the server


def test_the_unmasked_token_count_is_accepted_for_a_model_with_an_attention_mask(
        api: Api, transformer: dict[str, Any], store: Store) -> None:
    mask = [[1] * 20 + [0] * 10]
    body = {"model": "transformer", "inputs": {"input_ids": ids(30), "attention_mask": mask}}
    status, queued = submit(api, body | {"tokens": 20})
    assert status == 202
    assert json.loads(store.client.hget(store.keys.items, queued["id"]))["tokens"] == 30  # its length, not
    # by the count a client sends: 500 tokens with 1 unmasked would otherwise buy the express lane
    status, answer = submit(api, body | {"tokens": 5})
    assert status == 400 and "30 tokens (20 unmasked)" in answer["error"]


def test_tokens_on_a_model_without_a_sequence_axis_are_refused(api: Api, mlp: dict[str, Any]) -> None:
    status, body = submit(api, {"model": "mlp", "inputs": {"features": [[0.0] * 64]}, "tokens": 5})
    assert status == 400 and "no sequence axis" in body["error"]


def test_a_request_without_rows_is_told_to_send_one(api: Api, mlp: dict[str, Any]) -> None:
    response = api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": []}})

    assert response.status_code == 400
    assert error_of(response).endswith("it holds no rows: send at least one row of shape [64]")


def test_a_sequence_longer_than_the_model_declares_is_refused_at_submit(api: Api,
                                                                       transformer: dict[str, Any]) -> None:
    status, body = submit(api, {"model": "transformer", "inputs": {"input_ids": ids(TRANSFORMER_MAX_SEQUENCE + 1)}})
    assert status == 400 and "sits.max_sequence" in body["error"], body
    assert submit(api, {"model": "transformer", "inputs": {"input_ids": ids(TRANSFORMER_MAX_SEQUENCE)}})[0] == 202


def test_a_job_list_limit_out_of_range_is_a_400(api: Api) -> None:
    for limit in ("0", "-3", "x", "10001", "9" * 40):
        response = api.get(f"/v1/jobs?limit={limit}")
        assert response.status_code == 400 and "from 1 to 10000" in error_of(response), limit
    assert api.get("/v1/jobs?limit=10000").status_code == 200


def test_a_mask_of_other_values_than_0_and_1_and_negative_token_ids_are_refused(
        api: Api, transformer: dict[str, Any]) -> None:
    status, body = submit(api, {"model": "transformer",
                                "inputs": {"input_ids": ids(4), "attention_mask": [[1, 1, 2, 0]]}})
    assert status == 400 and "values other than 0 and 1" in body["error"]
    status, body = submit(api, {"model": "transformer", "inputs": {"input_ids": [[5, -1, 7, 8]]}})
    assert status == 400 and "negative token id (-1)" in body["error"]


def test_a_model_reference_with_an_empty_version_or_name_is_a_400_not_the_newest_version(
        api: Api, mlp: dict[str, Any]) -> None:
    for ref in ("mlp@", "@v1"):
        status, body = submit(api, {"model": ref, "inputs": {"features": [[0.0] * 64]}})
        assert status == 400 and "empty" in body["error"], (ref, body)
    assert api.get("/v1/models/mlp@").status_code == 400
    assert api.get("/v1/models/mlp").status_code == 200


def test_fields_are_not_coerced_from_other_json_types(api: Api, mlp: dict[str, Any]) -> None:
    """ "3" or true is not a priority, nor 1 a `wait`: the client meant something else, or sent it by mistake."""
    row = {"features": [[0.0] * 64]}
    for field, value in (("priority", "3"), ("priority", True), ("priority", 2.5), ("wait", 1), ("wait", "yes"),
                         ("deadline_ms", "100")):
        status, body = submit(api, {"model": "mlp", "inputs": row, field: value})
        assert status == 400 and field in body["error"], (field, value, body)
    assert submit(api, {"model": "mlp", "inputs": row, "priority": 3, "deadline_ms": 100})[0] == 202
    assert submit(api, {"model": "mlp", "inputs": row, "deadline_ms": 99.5})[0] == 202


def test_a_wait_query_parameter_that_is_not_true_or_false_is_a_400_before_anything_is_queued(
        api: Api, mlp: dict[str, Any]) -> None:
    for body_wait in (False, True):
        response = api.post("/v1/requests?wait=maybe", json={"model": "mlp", "inputs": {"features": [[0.0] * 64]},
                                                              "wait": body_wait})
        assert response.status_code == 400 and "'wait' must be true or false" in error_of(response)
    assert sum(depth["ready"] for depth in api.get("/v1/status").get_json()["queues"].values()) == 0


def test_token_ids_past_the_model_s_vocabulary_are_refused_at_submit(api: Api, transformer: dict[str, Any]) -> None:
    """The vocabulary is read from the graph (the rows of the embedding table the ids index)."""
    assert transformer["static_profile"]["vocabulary_size"] == TRANSFORMER_VOCAB
    status, body = submit(api, {"model": "transformer", "inputs": {"input_ids": [[5, TRANSFORMER_VOCAB, 7]]}})
    assert status == 400 and f"vocabulary has {TRANSFORMER_VOCAB} ids" in body["error"], body
    assert submit(api, {"model": "transformer", "inputs": {"input_ids": [[5, TRANSFORMER_VOCAB - 1, 7]]}})[0] == 202


def test_an_int_input_that_holds_no_token_ids_takes_negative_values(api: Api, tmp_path: Path) -> None:
    """An int64 [batch, steps] input summed over its steps (deltas, counts) is no token ids: a request and
    a job holding negative values are queued, not refused as negative token ids."""
    onnx.save(int_series_model(), tmp_path / "series.onnx")
    assert api.post("/v1/models", json={"name": "series", "path": str(tmp_path / "series.onnx")}).status_code == 201
    status, body = submit(api, {"model": "series", "inputs": {"x": [[3, -1, 4], [-5, 9, 2]]}})
    assert status == 202, body
    np.save(tmp_path / "series.npy", np.array([[-5, 9, 2]] * 4, dtype=np.int64))
    response = api.post("/v1/jobs", json={"model": "series", "input_batch": str(tmp_path / "series.npy"),
                                          "output_dir": str(tmp_path / "series-out")})
    assert response.status_code == 201, error_of(response)


def test_a_model_that_lists_its_mask_first_has_its_ids_checked_against_the_vocabulary(
        api: Api, tmp_path: Path) -> None:
    onnx.save(token_model(mask_first=True), tmp_path / "mask_first.onnx")
    record = api.post("/v1/models", json={"name": "mask_first", "path": str(tmp_path / "mask_first.onnx")}).get_json()
    assert record["static_profile"]["sequence_axis"] == {"input": "input_ids", "axis": 1}
    status, body = submit(api, {"model": "mask_first", "inputs": {"input_ids": [[5, 50, 7]]}})
    assert status == 400 and "vocabulary has 50 ids" in body["error"], body
    status, body = submit(api, {"model": "mask_first", "inputs": {"input_ids": [[5, -2, 7]]}})
    assert status == 400 and "negative token id (-2)" in body["error"], body
    assert submit(api, {"model": "mask_first", "inputs": {"input_ids": [[5, 49, 7]]}})[0] == 202

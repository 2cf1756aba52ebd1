"""POST /v2/models/{name}/infer refuses malformed bodies with a 400 naming the field, before anything is queued."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.api_helpers import Api, error_of, queued_items

INFER = "/v2/models/mlp/infer"


def features(**changes: Any) -> dict[str, Any]:
    """A valid input entry for the zoo MLP (one row of 64 features), with `changes` applied."""
    return {"name": "features", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64, **changes}


def infer_body(**changes: Any) -> dict[str, Any]:
    """A valid v2 infer body for the zoo MLP, with `changes` applied."""
    return {"id": "r1", "inputs": [features()], "outputs": [{"name": "logits"}], **changes}


@pytest.mark.parametrize(("changes", "field"), [
    pytest.param({"inputs": ["features"]}, "inputs[0]", id="input-not-an-object"),
    pytest.param({"inputs": [features(name=["features"])]}, "inputs[0].name", id="input-name-not-a-string"),
    pytest.param({"inputs": [features(datatype=["FP32"])]}, "datatype", id="datatype-a-list"),
    pytest.param({"inputs": [features(datatype={})]}, "datatype", id="datatype-an-object"),
    pytest.param({"inputs": [features(data=None)]}, "data", id="data-not-a-list"),
    pytest.param({"inputs": [features(), features()]}, "'features' is given more than once", id="duplicate-input-name"),
    pytest.param({"parameters": [1]}, "parameters", id="parameters-a-list"),
    pytest.param({"parameters": "x"}, "parameters", id="parameters-a-string"),
    pytest.param({"parameters": {"user_tier": "gold"}}, "user_tier", id="unknown-user-tier"),
    pytest.param({"parameters": {"user_tier": ["vip"]}}, "user_tier", id="user-tier-not-a-string"),
    pytest.param({"outputs": "logits"}, "outputs", id="outputs-a-string"),
    pytest.param({"outputs": ["logits"]}, "outputs[0]", id="output-not-an-object"),
    pytest.param({"outputs": [{"name": ["logits"]}]}, "outputs[0]", id="output-name-not-a-string"),
    pytest.param({"outputs": [{"name": "probabilities"}]}, "probabilities", id="unknown-output"),
    pytest.param({"outputs": [{"name": "logits"}, {"name": "logits"}]}, "'logits'", id="duplicate-output"),
    pytest.param({"id": 5}, "id", id="id-not-a-string"),
    pytest.param({"inputs": [features(data=["0.5"] * 64)]}, "not FP32 values", id="numbers-as-strings"),
    pytest.param({"inputs": [features(data=[True] * 64)]}, "not FP32 values", id="booleans-for-fp32"),
    pytest.param({"inputs": [features(datatype="INT64", data=[1.5] * 64)]}, "not INT64 values",
                 id="fractions-for-int64"),
    pytest.param({"inputs": [features(data=[1e39] * 64)]}, "does not fit float32", id="beyond-float32"),
    pytest.param({"inputs": [features(datatype="BOOL", data=[1, 0] * 32)]},
                 "not BOOL values: write a flat or nested list of true or false", id="numbers-for-bool"),
    pytest.param({"inputs": [features(shape=[1] * 70, data=[1.0])]}, "has 70 axes; a tensor has at most",
                 id="more-axes-than-numpy-builds"),  # (numpy's own refusal surfaced as a 500)
])
def test_a_malformed_infer_body_is_a_400_naming_the_field_and_queues_nothing(
        api: Api, mlp: dict[str, Any], changes: dict[str, Any], field: str) -> None:
    response = api.post(INFER, json=infer_body(**changes))
    assert response.status_code == 400, response.get_json()
    assert field in error_of(response)
    assert queued_items(api) == 0


def test_an_unknown_output_is_refused_before_inference_and_names_the_models_outputs(
        api: Api, mlp: dict[str, Any]) -> None:
    # A valid body does reach the queue: no worker runs here, so its 1 ms timeout passes while it waits
    # there, and it fails saying so. The bad one below never gets that far.
    valid = api.post(INFER, json=infer_body(parameters={"timeout": 1000}))
    assert valid.status_code == 504 and "while it waited in the queue" in error_of(valid)
    response = api.post(INFER, json=infer_body(outputs=[{"name": "logits"}, {"name": "probabilities"}],
                                               parameters={"timeout": 1000}))
    assert response.status_code == 400
    assert "'outputs'" in error_of(response) and "logits" in error_of(response)
    assert queued_items(api) == 0


def test_null_optional_fields_count_as_absent(api: Api, mlp: dict[str, Any]) -> None:
    response = api.post(INFER, json=infer_body(id=None, outputs=None, parameters={"timeout": 1000}))
    assert response.status_code == 504, response.get_json()  # queued and waited, not refused


def test_as_many_axes_as_numpy_builds_are_taken_and_one_more_is_refused() -> None:
    """A model may well have 40 axes (numpy 2 builds 64, ONNX Runtime runs them): only numpy's own limit,
    past which no array can hold the input, is a 400."""
    import numpy as np

    from broker.errors import BadInput
    from sits_worker.model.tensors import MAX_DIMS, check_buildable

    check_buildable("input 'x'", [1] * MAX_DIMS, 4)
    assert np.empty((1,) * MAX_DIMS).ndim == MAX_DIMS
    with pytest.raises(BadInput, match=f"has {MAX_DIMS + 1} axes"):
        check_buildable("input 'x'", [1] * (MAX_DIMS + 1), 4)

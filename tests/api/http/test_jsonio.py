"""The orjson-backed JSON provider behaves like Flask's own where orjson would differ."""

from __future__ import annotations

import json

import numpy as np
from flask import Flask, jsonify, request

from sits_api.http.jsonio import OrjsonProvider
from tests.api.api_helpers import Api, error_of


def make_app() -> Flask:
    app = Flask("jsonio-test")
    app.json = OrjsonProvider(app)
    app.json.sort_keys = False  # type: ignore[attr-defined]

    @app.post("/echo")
    def echo() -> object:
        return jsonify({"body": request.get_json(silent=True)})

    return app


def test_bodies_and_answers_round_trip_in_key_order() -> None:
    body = {"z": 1, "a": [[0.5, -1.25]], "nested": {"b": None, "a": True}}
    answer = make_app().test_client().post("/echo", json=body)

    assert answer.status_code == 200 and answer.mimetype == "application/json"
    assert list(answer.get_json()["body"]) == ["z", "a", "nested"]
    assert answer.get_json() == {"body": body}


def test_what_orjson_refuses_falls_back_to_the_standard_library() -> None:
    client = make_app().test_client()
    huge = 2**70  # wider than 64 bits
    huge_body = client.post("/echo", data=json.dumps({"x": huge}), content_type="application/json")

    assert huge_body.get_json() == {"body": {"x": huge}}


def test_what_is_not_json_is_refused_by_both_parsers() -> None:
    """NaN and Infinity literals (the standard library's extension) and nesting deeper than orjson's
    limit (the standard parser would recurse until the stack gives out) are not parsed."""
    client = make_app().test_client()
    for text in ('{"x": NaN}', '{"x": -Infinity}', '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 '{"x": 1e400}', '{"x": [-2.5e308]}'):  # orjson refuses these; json.loads made them infinite
        answer = client.post("/echo", data=text, content_type="application/json")
        assert answer.status_code == 200 and answer.get_json() == {"body": None}, text[:20]


def test_api_bodies_that_are_not_json_objects_get_a_400_that_says_why(api: Api) -> None:
    cases = {'{"alpha": NaN}': "NaN is not a JSON number", '{"alpha": Infinity}': "Infinity is not a JSON number",
             "[" * 100_000 + "]" * 100_000: "nested too deeply", "[1, 2]": "not a JSON list",
             '{"alpha": 0.5': "not valid JSON", '{"alpha": 1e400}': "1e400 is beyond the range of a 64-bit float",
             '{"alpha": 1' + "0" * 400 + "}": "is beyond the range of a 64-bit float"}
    for text, reason in cases.items():
        answer = api.client.put("/v1/policy", data=text, content_type="application/json", headers=api.headers)
        assert answer.status_code == 400 and reason in error_of(answer), (text[:20], error_of(answer))
    answer = api.client.put("/v1/policy", data='{"alpha": 0.5}', headers=api.headers)  # no JSON content type
    assert answer.status_code == 400 and "Content-Type: application/json" in error_of(answer)
    answer = api.post("/v1/requests", data='{"model": "mlp", "inputs": {"features": [[NaN]]}}',
                      content_type="application/json")
    assert answer.status_code == 400 and "NaN is not a JSON number" in error_of(answer)


def test_nan_and_numpy_values_are_written_as_valid_json() -> None:
    app = make_app()
    with app.app_context():
        text = app.json.dumps({"nan": float("nan"), "array": np.arange(3, dtype=np.float32), "scalar": np.int64(4)})
    assert json.loads(text) == {"nan": None, "array": [0.0, 1.0, 2.0], "scalar": 4}

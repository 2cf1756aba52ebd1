"""The orjson-backed JSON provider behaves like Flask's own where orjson would differ."""

from __future__ import annotations

import json

import numpy as np
from flask import Flask, jsonify, request

from sits_api.jsonio import OrjsonProvider


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
    nan_body = client.post("/echo", data='{"x": NaN}', content_type="application/json")
    huge_body = client.post("/echo", data=json.dumps({"x": huge}), content_type="application/json")

    assert nan_body.get_json() == {"body": {"x": None}}  # parsed (not refused), written back as valid JSON
    assert huge_body.get_json() == {"body": {"x": huge}}


def test_nan_and_numpy_values_are_written_as_valid_json() -> None:
    app = make_app()
    with app.app_context():
        text = app.json.dumps({"nan": float("nan"), "array": np.arange(3, dtype=np.float32), "scalar": np.int64(4)})
    assert json.loads(text) == {"nan": None, "array": [0.0, 1.0, 2.0], "scalar": 4}

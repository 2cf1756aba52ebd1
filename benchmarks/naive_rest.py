r"""The naive baseline behind REST: a Flask endpoint that runs each request as one Celery task.

What a hand-written Celery inference service usually is, and what SITS replaces: the view parses
the JSON body, calls `infer.delay(model_path, inputs).get()` (benchmarks/naive_celery.py: one
request per task, batch 1, no scheduler) and answers the outputs as JSON. It runs under the SITS
API's own gunicorn command (`sits_api.cli.stack.api_command`: worker class, processes, threads,
keep-alive) with SITS's JSON provider, so the two REST fronts differ only in what they do behind
the endpoint. benchmarks/online_serving.py measures it beside the client-side naive baseline (clients
calling Celery directly, no HTTP) and SITS.

Environment: `NAIVE_REDIS_URL` (broker and result backend, read by benchmarks.naive_celery) and
`NAIVE_MODELS`, a JSON object of model name -> ONNX file.

    NAIVE_REDIS_URL=redis://127.0.0.1:6379/0 NAIVE_MODELS='{"mlp": "/tmp/zoo/mlp.onnx"}' \
        python -m gunicorn benchmarks.naive_rest:app --workers 2 --threads 16 --keep-alive 30 \
        --worker-class sits_api.http.gunicorn_worker.JsonErrorThreadWorker
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from flask import Flask, jsonify, request

from benchmarks.naive_celery import infer
from sits_api.http.jsonio import OrjsonProvider

MODELS: dict[str, str] = json.loads(os.environ.get("NAIVE_MODELS", "{}"))
WAIT_SECONDS = 30.0

app = Flask("naive-rest")
app.json = OrjsonProvider(app)
app.json.sort_keys = False  # type: ignore[attr-defined]


@app.post("/v1/requests")
def run_request() -> Any:
    """Run `{"model": name, "inputs": {name: nested lists}}` as one Celery task and answer its outputs."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict):
        return jsonify({"error": "send a JSON object with 'model' and 'inputs'"}), 400
    path = MODELS.get(str(body.get("model")))
    if path is None:
        return jsonify({"error": f"unknown model {body.get('model')!r}; known: {sorted(MODELS)}"}), 404
    try:
        outputs = infer.delay(path, body["inputs"]).get(timeout=WAIT_SECONDS)
    except CeleryTimeout:
        return jsonify({"error": "the task did not finish in time"}), 504
    return jsonify({"status": "succeeded", "batch_size": 1, "outputs": outputs})

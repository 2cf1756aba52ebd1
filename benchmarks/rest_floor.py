r"""The REST floor of benchmarks/online_serving.py: a Flask app that only parses a request and answers it.

Same server as the SITS API (gunicorn started with the API's argv,
`sits_api.cli.stack.api_command`: its worker class, process and thread counts
and keep-alive; SITS's JSON provider), same client, same request bodies; it
runs no model and touches no Redis. Its req/s bounds what any Flask service
can answer on this machine with these clients, whatever it does behind the
endpoint.

    python -m gunicorn benchmarks.rest_floor:app --workers 2 --threads 16 --keep-alive 30 \
        --worker-class sits_api.gunicorn_worker.JsonErrorThreadWorker
"""

from __future__ import annotations

from typing import Any

from flask import Flask, jsonify, request

from sits_api.jsonio import OrjsonProvider

app = Flask("rest-floor")
app.json = OrjsonProvider(app)
app.json.sort_keys = False  # type: ignore[attr-defined]

_ANSWER = {"id": "r0", "model": "mlp", "model_version": "v", "status": "succeeded", "rows": 1, "batch_size": 1,
           "error": None, "outputs": {"logits": [[0.0] * 10]}}


@app.post("/v1/requests")
def answer() -> Any:
    """Parse the body as SITS does (JSON object), answer a result of the MLP's size."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return jsonify({"error": "the request body must be a JSON object"}), 400
    return jsonify(_ANSWER)

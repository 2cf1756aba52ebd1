r"""The REST floor: a Flask app that only parses a request and answers it, and what each hand-off adds.

Same server as the SITS API (started with the API's argv, `sits_api.cli.stack.api_command`: its
worker class, process and thread counts and keep-alive; SITS's JSON provider), same client, same
request bodies; it runs no model. Its req/s bounds what any Flask service can answer on this
machine with these clients, whatever it does behind the endpoint.

The ladder (`python benchmarks/rest_floor.py`) adds, one at a time, the two hand-offs every online
SITS request makes besides its own work: a Redis round trip (the submit script; here a PING on the
thread's own connection) and a result handed over by another thread (the result inbox's waiter
thread; here a thread that sets a Future). For each it prints req/s, CPU per request of the server
(and Redis) and the context switches per request of the server's threads, so the cost of a wake on
this machine can be read beside the cost of the work.

    python benchmarks/rest_floor.py                       # granian and gunicorn, 32 clients, 5 s a step
    python benchmarks/rest_floor.py --servers granian --seconds 10
    python benchmarks/rest_floor.py --servers granian,granian-rsgi   # and an async handler (RSGI) instead
    python -m gunicorn benchmarks.rest_floor:app --workers 2 --threads 16 --keep-alive 30 \
        --worker-class sits_api.http.gunicorn_worker.JsonErrorThreadWorker

`granian-rsgi` serves the same answer from an async handler under granian's RSGI interface, no Flask
and no request threads, its Redis round trip through `redis.asyncio`: what an async front would save
at the floor. It has no thread hand-off step (its waiter would be a task of the same event loop).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson
from flask import Flask, jsonify, request

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sits_api.http.jsonio import OrjsonProvider

RSGI_STEPS = ("plain", "redis")
"""The steps of `granian-rsgi`: an async handler hands nothing over between threads."""

STEPS = ("plain", "redis", "handoff", "redis+handoff")
"""What each request does besides parsing and answering: nothing, one Redis round trip, one result
handed over by another thread, or both (as a waiting SITS request does)."""

app = Flask("rest-floor")
app.json = OrjsonProvider(app)
app.json.sort_keys = False  # type: ignore[attr-defined]

_ANSWER = {"id": "r0", "model": "mlp", "model_version": "v", "status": "succeeded", "rows": 1, "batch_size": 1,
           "error": None, "outputs": {"logits": [[0.0] * 10]}}

_STEP = os.environ.get("SITS_FLOOR_STEP", "plain")  # (a benchmark's own app: read where it is served)
_REDIS_URL = os.environ.get("SITS_FLOOR_REDIS", "")
_local = threading.local()
_handed: queue.SimpleQueue[Future[int]] = queue.SimpleQueue()
_hander_lock = threading.Lock()
_hander: list[threading.Thread] = []


def _redis() -> Any:
    """This thread's own connection (as `broker.state.store.Store` holds one per thread)."""
    client = getattr(_local, "redis", None)
    if client is None:
        import redis

        client = _local.redis = redis.Redis.from_url(_REDIS_URL).client()
    return client


def _hand_over() -> None:
    """Wait for a Future that another thread sets, as a request waits for the result inbox's thread."""
    with _hander_lock:
        if not _hander:
            _hander.append(threading.Thread(target=_set_each, daemon=True, name="floor-hander"))
            _hander[0].start()
    future: Future[int] = Future()
    _handed.put(future)
    future.result(timeout=5)


def _set_each() -> None:
    while True:
        _handed.get().set_result(1)


_ANSWER_BYTES = orjson.dumps(_ANSWER)
_async_redis: list[Any] = []


async def rsgi_app(scope: Any, protocol: Any) -> None:
    """The floor as an async RSGI handler (`granian --interface rsgi`): parse, this step's Redis round
    trip, answer."""
    if scope.proto != "http":
        return
    try:
        body = orjson.loads(await protocol())
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        protocol.response_bytes(400, [("content-type", "application/json")],
                                b'{"error": "the request body must be a JSON object"}')
        return
    if "redis" in _STEP:
        if not _async_redis:
            import redis.asyncio

            _async_redis.append(redis.asyncio.Redis.from_url(_REDIS_URL, max_connections=64))
        await _async_redis[0].ping()
    protocol.response_bytes(200, [("content-type", "application/json")], _ANSWER_BYTES)


@app.post("/v1/requests")
def answer() -> Any:
    """Parse the body as SITS does (JSON object), make this step's hand-offs, answer a result of the MLP's size."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return jsonify({"error": "the request body must be a JSON object"}), 400
    if "redis" in _STEP:
        _redis().ping()
    if "handoff" in _STEP:
        _hand_over()
    return jsonify(_ANSWER)


# --- the ladder ------------------------------------------------------------------------------------


def run_step(server_name: str, step: str, redis_url: str, clients: int, seconds: float) -> dict[str, Any]:
    """One step of the ladder under one server: its req/s, CPU per request and context switches per request."""
    from benchmarks.online_serving import CpuMeter, context_switches, payloads, rest_load, serve_app, stop_process

    env = {"SITS_FLOOR_STEP": step, "SITS_FLOOR_REDIS": redis_url}
    if server_name == "granian-rsgi":
        server, url = serve_rsgi(env)
    else:
        server, url = serve_app("benchmarks.rest_floor:app", env=env, server_name=server_name)
    try:
        requests = payloads("mlp", 256, seed=1)
        rest_load(url, "mlp", requests, clients, 1.0, CpuMeter({}))  # warm-up: threads and connections made
        before = context_switches(server.pid, with_children=True)
        result = rest_load(url, "mlp", requests, clients, seconds, CpuMeter({"server api": server.pid}))
        switches = context_switches(server.pid, with_children=True) - before
        done = max(1, result["done"])
        return {"server": server_name, "step": step, "rps": result["rps"], "errors": result["errors"],
                "cpu_us": sum(result["cpu"].values()) / done * 1e6, "switches": switches / done}
    finally:
        stop_process(server)


def serve_rsgi(env: dict[str, str]) -> tuple[Any, str]:
    """`rsgi_app` under granian with the API's process count, on a free loopback port, once it accepts
    connections."""
    import subprocess

    from benchmarks.online_serving import ROOT, wait_until_serving
    from broker.config.settings import Settings
    from broker.state.embedded import free_port

    port, workers = free_port(), Settings().api.workers
    server = subprocess.Popen(
        [sys.executable, "-m", "granian", "--interface", "rsgi", "benchmarks.rest_floor:rsgi_app", "--host",
         "127.0.0.1", "--port", str(port), "--workers", str(workers), "--runtime-mode", "st", "--no-ws",
         "--log-level", "warning"],
        cwd=ROOT, env=dict(os.environ, **env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    return server, wait_until_serving(server, port, "the RSGI floor under granian")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="granian,gunicorn",
                        help="comma-separated: granian, gunicorn, granian-rsgi")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    from broker.state.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="sits-floor-") as tmp:
        redis_server = EmbeddedRedis(Path(tmp) / "redis", appendonly=False).start()
        try:
            rows = [run_step(name, step, redis_server.url, args.clients, args.seconds)
                    for name in args.servers.split(",")
                    for step in (RSGI_STEPS if name == "granian-rsgi" else STEPS)]
        finally:
            redis_server.stop(kill=True)
    print(f"\n{args.clients} clients, {args.seconds:g} s a step; CPU: the server's processes (Redis apart, "
          "a few us per PING)\n")
    print("| server | step | req/s | CPU us per request | context switches per request | errors |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['server']} | {row['step']} | {row['rps']:,.0f} | {row['cpu_us']:,.0f} | {row['switches']:.1f} "
              f"| {row['errors']} |")


if __name__ == "__main__":
    main()

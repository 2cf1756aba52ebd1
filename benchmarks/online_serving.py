"""Online requests: SITS (REST + Redis queue + batching worker) vs a naive Celery task per request.

Everything is measured in one run, on one machine, with one SITS stack:

1. ceiling: a bare ONNX Runtime loop with the worker's threads (2 streams x 1 intra-op thread sharing
   one session), at batch 1 and at the best batch of 1, 8, 32, 128;
2. naive baseline (benchmarks/naive_celery.py): C client threads each calling
   `infer.delay(model_path, inputs).get()` in a loop, one request per task (batch 1);
3. SITS online: the same C client threads POSTing `/v1/requests` with `"wait": true` (JSON lists;
   http.client, reconnecting when the server closes); the naive and SITS runs alternate, medians are reported;
4. idle latency: one client, sequential small MLP requests, submit-to-result through REST;
5. dynamic priority vs FIFO: free-tier clients keep a backlog of requests in the queue (convnet, and in
   full mode also the MLP, each registered again with a small max batch size) while a few vip clients send
   requests and wait for them; once under `{"ordering": "fifo"}`, once under
   `{"ordering": "dynamic"}` (PUT /v1/policy);
6. load scenarios (`--parts scenarios`), each under FIFO and under dynamic ordering: a burst of short
   transformer requests into a queue of long ones, long-context requests mixed with short ones, a surge of
   vip/free convnet requests after a quiet period, and three tenants (vip, premium, free) contending for
   convnet; transformer and convnet registered again with small max batch sizes (`transformer_b4`,
   `convnet_b2`); every request carries `deadline_ms`.

Both services share the embedded Redis and the 2 cores with the client threads; clients encode each
request's JSON and decode each answer on both sides.

    python benchmarks/online_serving.py --quick     # about 1 minute: 5 s runs, one of each
    python benchmarks/online_serving.py             # about 8 minutes: 15 s runs, 3 alternating repeats
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.config.settings import Settings  # noqa: E402
from broker.online import requests as broker_requests  # noqa: E402
from broker.online.requests import encode_array  # noqa: E402
from broker.state.embedded import free_port  # noqa: E402
from sits_api.cli.stack import Stack, api_command  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

STREAMS = 2  # worker threads (Celery threads pool) sharing one session per model
ORT_THREADS = 1  # intra-op threads per session: two streams share the 2 cores
NAIVE_CONCURRENCY = 4  # threads of the naive Celery worker


def queued_name(model: str, batch: int) -> str:
    """Scenario 5: the model registered again under this name, with its own (small) max batch size."""
    return f"{model}_b{batch}"

BATCHING_NOTE = {"static": "max_batch_size 64, max_queue_delay 0",
                 "full": "max_batch_size and max_queue_delay from the measured profile"}
MAX_REQUESTS_PER_THREAD = 200_000  # every load loop is bounded in count as well as in time

INPUTS: dict[str, tuple[str, tuple[int, ...]]] = {  # model: (input name, shape of one row)
    "mlp": ("features", (64,)),
    "convnet": ("pixels", (3, 32, 32)),
}


# --- helpers ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_threads(count: int, target: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def cpu_seconds(pid: int, *, with_children: bool = False) -> float:
    """User + system CPU seconds of process `pid` so far, from /proc (0 if it is gone); with
    `with_children` also its live children's (the API's gunicorn workers)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if with_children else []
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(int(child)) for child in children)


def context_switches(pid: int, *, with_children: bool = False) -> int:
    """Voluntary and involuntary context switches so far of every thread of process `pid` (from /proc; 0
    if it is gone); with `with_children` also its live children's (the API server's worker processes)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            total += sum(int(line.split()[1]) for line in status.read_text().splitlines() if "ctxt_switches:" in line)
        except OSError:
            continue  # (a thread that ended meanwhile)
    if with_children:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            children = []
        total += sum(context_switches(int(child)) for child in children)
    return total


class CpuMeter:
    """CPU seconds used by each named process between `start` and `stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}

    def start(self) -> None:
        self.before = {name: self._read(name, pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {name: self._read(name, pid) - self.before.get(name, 0.0) for name, pid in self.pids.items()}

    @staticmethod
    def _read(name: str, pid: int) -> float:
        return cpu_seconds(pid, with_children=name.endswith(" api"))  # gunicorn: the master and its workers


def payloads(model: str, count: int, seed: int = 0, *, b64: bool = False) -> list[dict[str, Any]]:
    """`count` different one-row requests of `model`: JSON nested lists, or base64 .npy with `b64`."""
    name, shape = INPUTS[model]
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((1, *shape), dtype=np.float32) for _ in range(count)]
    return [{name: {"b64": encode_array(array)} if b64 else array.tolist()} for array in arrays]


class Http:
    """One HTTP/1.1 connection to the API per client thread, kept open when the server allows it.

    The stack's API (gunicorn, gthread workers) keeps connections alive; the client reconnects when the
    server closes one.
    """

    def __init__(self, url: str, key: str, timeout: float = 60.0) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname or "127.0.0.1", parts.port or 80, timeout
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                        "Accept": "application/json"}
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(2):  # one reconnect: the server may close an idle keep-alive connection
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=data, headers=self.headers)
                response = self.conn.getresponse()
                raw = response.read()
                if response.getheader("Connection", "").lower() == "close":
                    self.close()
                return response.status, json.loads(raw) if raw else None
            except (http.client.HTTPException, ConnectionError, TimeoutError, OSError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# --- 1. ceiling ---------------------------------------------------------------------------------


def ceiling(model_path: Path, model: str, batch: int, seconds: float) -> float:
    """Rows/s of STREAMS threads running batches of `batch` on one session (ORT_THREADS threads each)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = ORT_THREADS
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    name, shape = INPUTS[model]
    feed = {name: np.random.default_rng(1).standard_normal((batch, *shape), dtype=np.float32)}
    session.run(None, feed)
    counts = [0] * STREAMS
    ends = time.perf_counter() + seconds

    def loop(index: int) -> None:
        for _ in range(MAX_REQUESTS_PER_THREAD):
            if time.perf_counter() >= ends:
                return
            session.run(None, feed)
            counts[index] += batch

    started = time.perf_counter()
    run_threads(STREAMS, loop)
    return sum(counts) / (time.perf_counter() - started)


# --- 2./3. closed-loop load ---------------------------------------------------------------------


def closed_loop(clients: int, seconds: float, make_call: Callable[[int], Callable[[int], Any]],
                meter: CpuMeter | None = None) -> dict[str, Any]:
    """`clients` threads, each calling its call(n) back to back for `seconds`; latencies in ms."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    extras: list[list[Any]] = [[] for _ in range(clients)]
    errors = [0] * clients
    barrier = threading.Barrier(clients + 1)
    window: dict[str, float] = {}

    def worker(index: int) -> None:
        call = make_call(index)
        barrier.wait()
        ends = window["ends"]
        for n in range(MAX_REQUESTS_PER_THREAD):
            if time.perf_counter() >= ends:
                return
            started = time.perf_counter()
            try:
                extra = call(n)
            except Exception:  # counted, not fatal: the figures say how many failed
                errors[index] += 1
                continue
            latencies[index].append((time.perf_counter() - started) * 1000)
            extras[index].append(extra)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    window["ends"] = time.perf_counter() + seconds
    if meter:
        meter.start()
    started = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join(seconds + 90)
    elapsed = time.perf_counter() - started
    cpu = meter.stop() if meter else {}
    flat = [value for per_thread in latencies for value in per_thread]
    return {"done": len(flat), "errors": sum(errors), "rps": len(flat) / elapsed,
            "p50": percentile(flat, 50), "p99": percentile(flat, 99),
            "extras": [value for per_thread in extras for value in per_thread], "cpu": cpu, "elapsed": elapsed}


def naive_load(infer: Any, model_path: Path, requests: list[dict[str, list]], clients: int,
               seconds: float, meter: CpuMeter) -> dict[str, Any]:
    def make_call(index: int) -> Callable[[int], Any]:
        def call(n: int) -> None:
            out = infer.delay(str(model_path), requests[(index * 7919 + n) % len(requests)]).get(timeout=30)
            if "logits" not in out:
                raise RuntimeError("no logits in the answer")
        return call

    return closed_loop(clients, seconds, make_call, meter)


def sits_load(stack: Stack, model: str, requests: list[dict[str, list]], clients: int,
              seconds: float, meter: CpuMeter) -> dict[str, Any]:
    """`rest_load` against the stack's API, with the mean batch its answers report."""
    result = rest_load(stack.api_url, model, requests, clients, seconds, meter, api_key=stack.api_key)
    batches = [batch for batch in result["extras"] if batch is not None]
    result["mean_batch"] = float(np.mean(batches)) if batches else float("nan")
    return result


# --- naive worker ----------------------------------------------------------------------------------


def start_naive_worker(redis_url: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, NAIVE_REDIS_URL=redis_url, NAIVE_ORT_THREADS=str(ORT_THREADS), PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "benchmarks.naive_celery", "worker", "--pool", "threads",
             "-c", str(NAIVE_CONCURRENCY), "--loglevel", "WARNING", "--without-mingle", "--without-gossip",
             "--hostname", f"naive-{os.getpid()}@%h"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """Stop exactly this child: SIGTERM (warm shutdown), SIGKILL after 20 s."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve_app(app: str, *, env: dict[str, str] | None = None, log_path: Path | None = None,
              server_name: str = "gunicorn") -> tuple[subprocess.Popen[bytes], str]:
    """Another WSGI app under the API's own command for `server_name`, gunicorn or granian
    (sits_api.cli.stack.api_command), on a free loopback port; returns the server and its URL once it
    accepts connections."""
    port = free_port()
    settings = Settings().with_overrides(api={"host": "127.0.0.1", "port": port, "server": server_name})
    with open(log_path or os.devnull, "ab") as log:
        server = subprocess.Popen(api_command(settings, app=app), cwd=ROOT, env=dict(os.environ, **(env or {})),
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return server, wait_until_serving(server, port, f"{app} under {server_name}")


def wait_until_serving(server: subprocess.Popen[bytes], port: int, what: str) -> str:
    """The URL of `server` once it accepts connections on loopback `port` (30 s at most; stopped and a
    RuntimeError naming `what` if it does not, or exits first)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                stop_process(server)
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


def rest_load(url: str, model: str, requests: list[dict[str, list]], clients: int, seconds: float,
              meter: CpuMeter, *, api_key: str = "none") -> dict[str, Any]:
    """Closed loop of the SITS clients' POSTs with `"wait": true` against a REST service (SITS, the floor,
    naive REST); each call's extra is the `batch_size` the answer reports (None where it has none)."""
    connections: list[Http] = []

    def make_call(index: int) -> Callable[[int], Any]:
        http_ = Http(url, api_key)
        connections.append(http_)

        def call(n: int) -> int | None:
            status, body = http_.call("POST", "/v1/requests", {
                "model": model, "inputs": requests[(index * 7919 + n) % len(requests)], "wait": True})
            if status != 200 or body.get("status") != "succeeded":
                raise RuntimeError(f"{status}: {body}")
            return body.get("batch_size")
        return call

    try:
        return closed_loop(clients, seconds, make_call, meter)
    finally:
        for connection in connections:
            connection.close()


def rest_floor(requests: list[dict[str, list]], clients: int, seconds: float, model: str) -> dict[str, Any]:
    """Closed loop against benchmarks/rest_floor.py under the API's gunicorn settings: what REST alone costs."""
    server, url = serve_app("benchmarks.rest_floor:app")
    try:
        return rest_load(url, model, requests, clients, seconds,
                         CpuMeter({"clients (bench)": os.getpid(), "SITS api": server.pid}))
    finally:
        stop_process(server)


# --- 4. idle latency ---------------------------------------------------------------------------------


def idle_latency(stack: Stack, count: int, gap: float) -> dict[str, float]:
    """One client, `count` sequential one-row MLP requests with `gap` s between them (the worker idles)."""
    http_ = Http(stack.api_url, stack.api_key)
    requests = payloads("mlp", 16, seed=4)
    client_ms, server_ms = [], []
    try:
        for n in range(count):
            time.sleep(gap)
            started = time.perf_counter()
            status, body = http_.call("POST", "/v1/requests", {"model": "mlp", "inputs": requests[n % 16],
                                                               "wait": True})
            elapsed = (time.perf_counter() - started) * 1000
            if status == 200 and body.get("status") == "succeeded":
                client_ms.append(elapsed)
                server_ms.append(float(body["latency_ms"]))
    finally:
        http_.close()
    return {"count": count, "ok": len(client_ms), "p50": percentile(client_ms, 50), "p99": percentile(client_ms, 99),
            "server_p50": percentile(server_ms, 50), "server_p99": percentile(server_ms, 99)}


# --- 5. dynamic priority vs FIFO ---------------------------------------------------------------------------


def priority_phase(stack: Stack, ordering: str, *, model: str, batch: int, free_clients: int, vip_clients: int,
                   backlog: int, seconds: float) -> dict[str, Any]:
    """Free clients keep about `backlog` requests waiting (submitted without waiting); vip clients wait."""
    status, body = Http(stack.api_url, stack.api_key).call("PUT", "/v1/policy", {"ordering": ordering})
    if status != 200 or body.get("ordering") != ordering:
        raise SystemExit(f"PUT /v1/policy failed: {status} {body}")
    queued = queued_name(model, batch)
    record = stack.client().get(f"/v1/models/{queued}")
    ready_key = stack.store.keys.ready(f"{queued}@{record['version']}")
    redis = stack.store.client
    free_requests = payloads(model, 64, seed=5, b64=True)  # cheap to parse: the API's core goes to submitting
    vip_requests = payloads(model, 64, seed=6, b64=True)
    free_ids: list[list[str]] = [[] for _ in range(free_clients)]
    vip_client_ms: list[list[float]] = [[] for _ in range(vip_clients)]
    vip_ids: list[list[str]] = [[] for _ in range(vip_clients)]
    errors = [0]
    t0 = time.time()
    ends = time.perf_counter() + seconds

    def free(index: int) -> None:
        http_ = Http(stack.api_url, stack.api_key)
        try:
            for n in range(MAX_REQUESTS_PER_THREAD):
                if time.perf_counter() >= ends:
                    return
                if redis.zcard(ready_key) >= backlog:
                    time.sleep(0.002)
                    continue
                status, body = http_.call("POST", "/v1/requests", {
                    "model": queued, "inputs": free_requests[n % 64], "priority": 0, "user_tier": "free"})
                if status == 202:
                    free_ids[index].append(body["id"])
                else:
                    errors[0] += 1
        finally:
            http_.close()

    def vip(index: int) -> None:
        http_ = Http(stack.api_url, stack.api_key)
        try:
            for n in range(MAX_REQUESTS_PER_THREAD):
                if time.perf_counter() >= ends:
                    return
                started = time.perf_counter()
                status, body = http_.call("POST", "/v1/requests", {
                    "model": queued, "inputs": vip_requests[n % 64], "priority": 8, "user_tier": "vip",
                    "wait": True})
                if status == 200 and body.get("status") == "succeeded":
                    vip_client_ms[index].append((time.perf_counter() - started) * 1000)
                    vip_ids[index].append(body["id"])
                else:
                    errors[0] += 1
        finally:
            http_.close()

    depths: list[int] = []

    def sample_depth() -> None:
        for _ in range(MAX_REQUESTS_PER_THREAD):
            if time.perf_counter() >= ends:
                return
            depths.append(int(redis.zcard(ready_key)))
            time.sleep(0.05)

    run_threads(free_clients + vip_clients + 1, lambda i: free(i) if i < free_clients else
                vip(i - free_clients) if i < free_clients + vip_clients else sample_depth())
    t1 = time.time()
    drain_deadline = time.monotonic() + 120  # the backlog left behind must not spill into the next phase
    while redis.zcard(ready_key) and time.monotonic() < drain_deadline:
        time.sleep(0.05)
    free_records = fetch_records(stack, [i for ids in free_ids for i in ids], until=drain_deadline)
    vip_records = fetch_records(stack, [i for ids in vip_ids for i in ids], until=drain_deadline)
    free_ms = [(r[1] - r[0]) * 1000 for r in free_records if r[1]]
    vip_ms = [(r[1] - r[0]) * 1000 for r in vip_records if r[1]]
    done_in_window = sum(1 for r in free_records + vip_records if r[1] and t0 <= r[1] <= t1)
    vip_client = [value for per_thread in vip_client_ms for value in per_thread]
    return {
        "model": model, "ordering": ordering, "batch": batch, "depth": float(np.mean(depths)) if depths else 0.0,
        "seconds": t1 - t0, "rps": done_in_window / (t1 - t0),
        "errors": errors[0],
        "vip_n": len(vip_ms), "vip_p50": percentile(vip_ms, 50), "vip_p99": percentile(vip_ms, 99),
        "vip_client_p99": percentile(vip_client, 99),
        "free_n": len(free_ms), "free_p50": percentile(free_ms, 50), "free_p99": percentile(free_ms, 99),
        "free_max": max(free_ms) if free_ms else float("nan"),
        "free_unfinished": sum(1 for r in free_records if not r[1]),
        "mean_batch": float(np.mean(batches)) if (batches := [r[2] for r in free_records + vip_records if r[2]])
        else float("nan"),
    }


def fetch_records(stack: Stack, ids: list[str], *, until: float) -> list[tuple[float, float | None, int | None]]:
    """(created_at, finished_at or None, batch_size) of each request, waiting for stragglers until `until`."""
    redis = stack.store.client
    records: list[tuple[float, float | None, int | None]] = []
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
        while True:
            pipe = redis.pipeline(transaction=False)
            for request_id in part:
                pipe.hmget(stack.store.keys.request(request_id), ["created_at", "finished_at", "batch_size"])
            rows = pipe.execute()
            if all(row[1] for row in rows) or time.monotonic() >= until:
                break
            time.sleep(0.05)
        records += [(float(c), float(f) if f else None, int(b) if b else None) for c, f, b in rows]
    return records


# --- 6. load scenarios, FIFO vs dynamic ---------------------------------------------------------------------

SCENARIO_MODELS: tuple[tuple[str, int], ...] = (("transformer", 4), ("convnet", 2))  # registered as <model>_b<N>


@dataclass
class Load:
    """One class of requests in a scenario, sent by `clients` threads starting `start` s into the phase.

    mode: "closed" (wait for each answer), "backlog" (no wait; keep the model's ready queue under `backlog`),
    "rate" (no wait; `rate` req/s over all its clients, skipped while the ready queue holds `backlog`, if set),
    "burst" (no wait; `count` requests in all, as fast as the clients can submit them).
    """

    label: str
    model: str
    requests: list[dict[str, Any]]
    priority: int
    tier: str
    deadline_ms: float
    clients: int
    mode: str
    backlog: int = 0
    rate: float = 0.0
    count: int = 0
    start: float = 0.0


def set_ordering(stack: Stack, ordering: str) -> None:
    status, body = Http(stack.api_url, stack.api_key).call("PUT", "/v1/policy", {"ordering": ordering})
    if status != 200 or body.get("ordering") != ordering:
        raise SystemExit(f"PUT /v1/policy failed: {status} {body}")


def token_payloads(lengths: list[int], seed: int) -> list[dict[str, Any]]:
    """One-row transformer requests (base64 .npy int64 token ids), one per entry of `lengths`."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": {"b64": encode_array(rng.integers(0, 1000, (1, length), dtype=np.int64))}}
            for length in lengths]


def scenario_phase(stack: Stack, ordering: str, loads: list[Load], seconds: float) -> dict[str, Any]:
    """Run every load for `seconds` under `ordering`, drain the queues, read each request's server record.

    Per class: finished n, P99/longest of created-to-finished, share of the completions inside the window;
    overall: req/s over the served span (first created to last finished), share over deadline.
    """
    set_ordering(stack, ordering)
    redis = stack.store.client
    ready_keys = {}
    for load in loads:
        if load.model not in ready_keys:
            record = stack.client().get(f"/v1/models/{load.model}")
            ready_keys[load.model] = stack.store.keys.ready(f"{load.model}@{record['version']}")
    threads = [(load, i) for load in loads for i in range(load.clients)]
    ids: list[list[str]] = [[] for _ in threads]
    errors = [0]
    t0 = time.time()
    begins = time.perf_counter()
    ends = begins + seconds

    def client(index: int) -> None:
        load, number = threads[index]
        http_ = Http(stack.api_url, stack.api_key)
        time.sleep(max(0.0, min(load.start, seconds)))
        gap = load.clients / load.rate if load.mode == "rate" else 0.0
        next_at = time.perf_counter() + gap * number / load.clients
        try:
            for n in range(MAX_REQUESTS_PER_THREAD):
                if time.perf_counter() >= ends:
                    return
                if load.mode == "burst" and number + n * load.clients >= load.count:
                    return
                if load.mode == "rate":
                    time.sleep(max(0.0, min(next_at - time.perf_counter(), ends - time.perf_counter())))
                    next_at += gap
                    if time.perf_counter() >= ends:
                        return
                if (load.backlog and load.mode in ("backlog", "rate")
                        and redis.zcard(ready_keys[load.model]) >= load.backlog):
                    if load.mode == "backlog":
                        time.sleep(0.002)
                    continue
                wait = load.mode == "closed"
                status, body = http_.call("POST", "/v1/requests", {
                    "model": load.model, "inputs": load.requests[(number * 7919 + n) % len(load.requests)],
                    "priority": load.priority, "user_tier": load.tier, "deadline_ms": load.deadline_ms,
                    "wait": wait})
                if status not in (200, 202):
                    errors[0] += 1
                    continue
                ids[index].append(body["id"])
                if wait and status == 202:  # the API waits at most deadline_ms: wait for the rest here
                    broker_requests.wait_for_request(stack.store, body["id"], timeout=30)
        except Exception:  # counted, not fatal
            errors[0] += 1
        finally:
            http_.close()

    run_threads(len(threads), client)
    t1 = time.time()
    drain_deadline = time.monotonic() + 120
    while any(redis.zcard(key) for key in ready_keys.values()) and time.monotonic() < drain_deadline:
        time.sleep(0.05)
    classes: dict[str, dict[str, Any]] = {}
    all_records = []
    for load in loads:
        records = fetch_records(stack, [i for (lo, _), per in zip(threads, ids, strict=True) if lo is load
                                        for i in per], until=drain_deadline)
        all_records += [(r, load.deadline_ms) for r in records]
        ms = [(r[1] - r[0]) * 1000 for r in records if r[1]]
        entry = classes.setdefault(load.label, {"ms": [], "in_window": 0, "unfinished": 0, "over": 0})
        entry["ms"] += ms
        entry["in_window"] += sum(1 for r in records if r[1] and t0 <= r[1] <= t1)
        entry["unfinished"] += sum(1 for r in records if not r[1])
        entry["over"] += sum(1 for value in ms if value > load.deadline_ms)
    finished = [r for r, _ in all_records if r[1]]
    in_window = sum(entry["in_window"] for entry in classes.values())
    span = (max(r[1] for r in finished) - min(r[0] for r in finished)) if finished else float("nan")
    lowest = loads[-1].label  # the last load listed is the lowest class
    return {
        "ordering": ordering, "rps": len(finished) / span if finished else float("nan"),
        "over": sum(entry["over"] for entry in classes.values()) / max(len(finished), 1),
        "errors": errors[0], "unfinished": sum(entry["unfinished"] for entry in classes.values()),
        "lowest": lowest, "lowest_max": max(classes[lowest]["ms"]) if classes[lowest]["ms"] else float("nan"),
        "classes": {label: {"n": len(entry["ms"]), "p99": percentile(entry["ms"], 99),
                            "share": entry["in_window"] / max(in_window, 1)} for label, entry in classes.items()},
    }


def scenarios(seconds: float) -> list[tuple[str, Callable[[], list[Load]], float]]:
    """(title, loads, phase seconds) of the four scenarios; the last load of each is its lowest class."""
    transformer, convnet = queued_name("transformer", 4), queued_name("convnet", 2)
    rng = np.random.default_rng(11)
    return [
        ("Burst of short requests: 4 free clients keep up to 32 long transformer requests (256 tokens) waiting;"
         " 0.5 s in, 16 premium threads submit 200 short ones (8 tokens) at once; deadlines 500 ms short,"
         " 5 s long", lambda: [
             Load("short", transformer, token_payloads([8] * 32, 12), 4, "premium", 500, 16, "burst", count=200,
                  start=0.5),
             Load("long", transformer, token_payloads([256] * 16, 13), 0, "free", 5000, 4, "backlog", backlog=32)],
         seconds),
        ("Long context: transformer requests of 256-512 tokens at 200 req/s (free, deadline 3 s, skipped while"
         " 64 wait) mixed with 16-token ones at 60 req/s (premium, deadline 300 ms), open loop", lambda: [
             Load("short", transformer, token_payloads([16] * 32, 14), 4, "premium", 300, 4, "rate", rate=60),
             Load("long", transformer, token_payloads([int(v) for v in rng.integers(256, 513, 16)], 15), 0,
                  "free", 3000, 4, "rate", rate=200, backlog=64)],
         seconds),
        ("Surge after quiet: 2 s with no requests, then 16 threads submit 8 convnet requests each at once"
         " (4 vip threads, priority 8; 12 free threads, priority 0); deadline 500 ms for all", lambda: [
             Load("vip", convnet, payloads("convnet", 32, seed=16, b64=True), 8, "vip", 500, 4, "burst",
                  count=32, start=2.0),
             Load("free", convnet, payloads("convnet", 32, seed=17, b64=True), 0, "free", 500, 12, "burst",
                  count=96, start=2.0)],
         seconds + 2.0),
        ("Multi-tenant contention: closed-loop convnet clients, 4 vip (priority 8, deadline 200 ms),"
         " 6 premium (priority 4, 500 ms), 8 free (priority 0, 2 s); share = share of the completions", lambda: [
             Load("vip", convnet, payloads("convnet", 32, seed=18, b64=True), 8, "vip", 200, 4, "closed"),
             Load("premium", convnet, payloads("convnet", 32, seed=19, b64=True), 4, "premium", 500, 6, "closed"),
             Load("free", convnet, payloads("convnet", 32, seed=20, b64=True), 0, "free", 2000, 8, "closed")],
         seconds),
    ]


def print_scenarios(results: list[tuple[str, list[dict[str, Any]]]]) -> None:
    for title, phases in results:
        labels = list(phases[0]["classes"])
        print(f"\n#### {title}\n")
        print("| ordering | req/s | over deadline | " + " | ".join(f"{label} n | {label} P99 ms | {label} share"
                                                             for label in labels)
              + f" | {phases[0]['lowest']} longest ms | errors/unfinished |")
        print("| --- | ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in labels) + " | ---: | ---: |")
        for phase in phases:
            cells = " | ".join(f"{c['n']} | {c['p99']:.1f} | {c['share'] * 100:.0f} %"
                               for c in (phase["classes"][label] for label in labels))
            print(f"| {phase['ordering']} | {phase['rps']:,.0f} | {phase['over'] * 100:.1f} % | {cells} |"
                  f" {phase['lowest_max']:.1f} | {phase['errors']}/{phase['unfinished']} |")


# --- main ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (about 2 minutes in all)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client threads (naive and SITS)")
    parser.add_argument("--seconds", type=float, help="length of one load run (default 5 quick, 15 full)")
    parser.add_argument("--repeats", type=int, help="alternating naive/SITS runs per model (default 1 quick, 3 full)")
    parser.add_argument("--models", default="mlp,convnet")
    parser.add_argument("--parts", default="ceiling,load,floor,idle,priority,scenarios",
                        help="which parts to run (floor: REST alone, measured after each model's load runs)")
    parser.add_argument("--priority-cases", help="scenario 5 as model:max_batch_size, comma-separated"
                        " (default convnet:1 quick, convnet:1,mlp:8 full)")
    parser.add_argument("--backlog", type=int, default=128, help="waiting free requests kept in scenario 5")
    parser.add_argument("--json", type=Path, help="also write the results here, for benchmarks/charts.py")
    parser.add_argument("--profile-mode", choices=("static", "full"), default="static",
                        help="how the load models (2./3.) are registered: full = measured profile, so their"
                             " `auto` batching settings follow it (broker/online/batching.py)")
    args = parser.parse_args()
    seconds = args.seconds or (5.0 if args.quick else 15.0)
    repeats = args.repeats or (1 if args.quick else 3)
    ceiling_seconds = 1.0 if args.quick else 3.0
    idle_count = 50 if args.quick else 100
    models = args.models.split(",")
    parts = set(args.parts.split(","))
    cases = [(case.partition(":")[0], int(case.partition(":")[2]))
             for case in (args.priority_cases or ("convnet:1" if args.quick else "convnet:1,mlp:8")).split(",")]
    begun = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="sits-online-") as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "zoo")

        # 1. ceiling, before anything else runs
        ceilings: dict[str, tuple[float, int, float]] = {}
        for model in models if "ceiling" in parts else ():
            per_batch = {batch: ceiling(zoo[model], model, batch, ceiling_seconds) for batch in (1, 8, 32, 128)}
            best = max(per_batch, key=lambda b: per_batch[b])
            ceilings[model] = (per_batch[1], best, per_batch[best])
            print(f"[{time.monotonic() - begun:5.0f}s] ceiling {model}: {per_batch}", file=sys.stderr, flush=True)

        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": STREAMS, "intra_op_threads": ORT_THREADS},
            online={"models": {queued_name(model, batch): {"max_batch_size": batch}
                               for model, batch in [*cases, *SCENARIO_MODELS]}},
        )
        stack = Stack(settings, worker_count=1, api_port=0)
        naive: subprocess.Popen[bytes] | None = None
        naive_api: subprocess.Popen[bytes] | None = None
        naive_api_url = ""
        load_rows: list[tuple[str, dict, dict, dict]] = []  # model, naive, naive REST, SITS
        floors: dict[str, dict[str, Any]] = {}
        idle: dict[str, float] = {}
        phases: list[dict[str, Any]] = []
        scenario_results: list[tuple[str, list[dict[str, Any]]]] = []
        extra = [case for case in SCENARIO_MODELS if case not in cases] if "scenarios" in parts else []
        try:
            stack.start()
            client = stack.client()
            for model in models:
                record = client.post("/v1/models", {"name": model, "path": str(zoo[model]),
                                                    "profile_mode": args.profile_mode})
                while record["profile_status"] == "pending":  # a worker measures it (profile_mode full)
                    time.sleep(0.2)
                    record = client.get(f"/v1/models/{model}")
                batching = client.get(f"/v1/models/{model}")["batching"]
                print(f"[{time.monotonic() - begun:5.0f}s] {model} batching {batching}", file=sys.stderr, flush=True)
            for model, batch in [*cases, *extra]:
                client.post("/v1/models", {"name": queued_name(model, batch), "path": str(zoo[model])})
            os.environ["NAIVE_REDIS_URL"] = stack.settings.redis.url  # before the import: the app reads it
            from benchmarks.naive_celery import infer

            if "load" in parts:
                naive = start_naive_worker(stack.settings.redis.url, home / "logs" / "naive-worker.log")
                naive_api, naive_api_url = serve_app(
                    "benchmarks.naive_rest:app", log_path=home / "logs" / "naive-api.log",
                    env={"NAIVE_REDIS_URL": stack.settings.redis.url,
                         "NAIVE_MODELS": json.dumps({model: str(zoo[model]) for model in models})})
            for model in models if "load" in parts else ():  # warm-up both sides: sessions built, connections open
                requests = payloads(model, 64, seed=2)
                for _ in range(4):
                    infer.delay(str(zoo[model]), requests[0]).get(timeout=120)
                    Http(naive_api_url, "none").call("POST", "/v1/requests", {"model": model, "inputs": requests[0]})
                    client.post("/v1/requests", {"model": model, "inputs": requests[0], "wait": True})
            for model, batch in cases:
                client.post("/v1/requests", {"model": queued_name(model, batch), "inputs": payloads(model, 1)[0],
                                             "wait": True})
            for model, batch in extra:  # warm-up: sessions built (the transformer at both ends of its lengths)
                warm = (token_payloads([8, 512], 10) if model == "transformer"
                        else payloads(model, 1, b64=True))
                for inputs in warm:
                    client.post("/v1/requests", {"model": queued_name(model, batch), "inputs": inputs, "wait": True})
            print(f"[{time.monotonic() - begun:5.0f}s] stack and naive worker up", file=sys.stderr, flush=True)
            redis_pid = stack.redis.process.pid if stack.redis and stack.redis.process else 0
            pids = {"clients (bench)": os.getpid(), "redis": redis_pid, "naive worker": naive.pid if naive else 0,
                    "naive api": naive_api.pid if naive_api else 0}
            pids.update({f"SITS {child.name}": child.process.pid for child in stack.children})
            meter = CpuMeter(pids)

            # 2./3. naive vs SITS, alternating
            for model in models if "load" in parts else ():
                requests = payloads(model, 256, seed=3)
                naive_runs, naive_rest_runs, sits_runs = [], [], []
                for repeat in range(repeats):
                    naive_runs.append(naive_load(infer, zoo[model], requests, args.clients, seconds, meter))
                    naive_rest_runs.append(rest_load(naive_api_url, model, requests, args.clients, seconds, meter))
                    sits_runs.append(sits_load(stack, model, requests, args.clients, seconds, meter))
                    print(f"[{time.monotonic() - begun:5.0f}s] {model} repeat {repeat}: naive "
                          f"{naive_runs[-1]['rps']:.0f} req/s, naive REST {naive_rest_runs[-1]['rps']:.0f} req/s,"
                          f" SITS {sits_runs[-1]['rps']:.0f} req/s (batch {sits_runs[-1]['mean_batch']:.1f})",
                          file=sys.stderr, flush=True)
                load_rows.append((model, median_run(naive_runs), median_run(naive_rest_runs), median_run(sits_runs)))
                if "floor" in parts:
                    floors[model] = rest_floor(requests, args.clients, seconds, model)
                    print(f"[{time.monotonic() - begun:5.0f}s] {model} REST floor {floors[model]['rps']:.0f} req/s",
                          file=sys.stderr, flush=True)
            stop_process(naive_api)
            stop_process(naive)
            naive, naive_api = None, None

            # 4. idle latency
            if "idle" in parts:
                idle = idle_latency(stack, idle_count, gap=0.02)
                print(f"[{time.monotonic() - begun:5.0f}s] idle: {idle}", file=sys.stderr, flush=True)

            # 5. dynamic priority vs FIFO
            for model, batch in cases if "priority" in parts else ():
                for _ in range(repeats):
                    for ordering in ("fifo", "dynamic"):
                        phases.append(priority_phase(stack, ordering, model=model, batch=batch,
                                                     free_clients=12, vip_clients=4, backlog=args.backlog,
                                                     seconds=seconds))
                        print(f"[{time.monotonic() - begun:5.0f}s] priority {ordering}: {phases[-1]}",
                              file=sys.stderr, flush=True)

            # 6. load scenarios, FIFO vs dynamic
            scenario_list = scenarios(3.5 if args.quick else seconds) if "scenarios" in parts else []
            for title, loads, phase_seconds in scenario_list:
                runs = []
                for ordering in ("fifo", "dynamic"):
                    runs.append(scenario_phase(stack, ordering, loads(), phase_seconds))
                    print(f"[{time.monotonic() - begun:5.0f}s] scenario {title[:20]!r} {ordering}: {runs[-1]}",
                          file=sys.stderr, flush=True)
                scenario_results.append((title, runs))
        finally:
            stop_process(naive_api)
            stop_process(naive)
            stack.stop()

    print_report(args, seconds, repeats, ceilings, load_rows, idle, phases, idle_count, floors)
    if scenario_results:
        print("\n### Load scenarios, FIFO vs dynamic priority: latency = created to finished in the server's"
              " record; over deadline = share of all finished requests with latency > their deadline_ms;"
              " req/s over the served span (first created to last finished, queues drained); share = share of"
              " the completions inside the load window")
        print_scenarios(scenario_results)
    print(f"\n(total wall time {time.monotonic() - begun:.0f} s)")
    if args.json:
        results = {"quick": args.quick, "ceilings": ceilings, "idle": idle, "priority": phases, "floors": floors,
                   "load": [{"model": model, "naive": naive, "naive_rest": naive_rest, "sits": sits}
                            for model, naive, naive_rest, sits in load_rows],
                   "scenarios": [{"title": title, "runs": runs} for title, runs in scenario_results]}
        args.json.write_text(json.dumps(results, indent=1, default=str))


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median req/s (its own p50/p99 go with it), plus the min and max req/s."""
    ordered = sorted(runs, key=lambda run: run["rps"])
    middle = dict(ordered[len(ordered) // 2])
    middle["rps_range"] = (ordered[0]["rps"], ordered[-1]["rps"])
    middle["errors"] = sum(run["errors"] for run in runs)
    return middle


def print_report(args: argparse.Namespace, seconds: float, repeats: int, ceilings: dict, load_rows: list,
                 idle: dict, phases: list, idle_count: int, floors: dict[str, dict[str, Any]]) -> None:
    print(f"\nConfiguration: 2 vCPUs; SITS = 1 CPU worker, {STREAMS} streams x {ORT_THREADS} ONNX Runtime intra-op"
          f" thread, scheduler.policy {Settings().scheduler.policy}, default batching, load models registered"
          f" {args.profile_mode} ({BATCHING_NOTE[args.profile_mode]}), API gunicorn {Settings().api.workers}"
          f" processes x {Settings().api.threads} threads,"
          f" embedded Redis (AOF everysec); naive = Celery threads pool -c {NAIVE_CONCURRENCY}, {ORT_THREADS} intra-op"
          f" thread, same Redis as broker and result backend; {args.clients} client threads in the benchmark"
          f" process; one-row requests as JSON lists; {seconds:.0f} s per load run, {repeats} alternating"
          f" run(s) per side (median by req/s).")
    if ceilings:
        print(f"\n### Ceiling: bare ONNX Runtime, {STREAMS} threads x {ORT_THREADS} intra-op thread on one session\n")
        print("| model | batch 1 rows/s | best batch | best rows/s |")
        print("| --- | ---: | ---: | ---: |")
        for model, (one, best, best_rate) in ceilings.items():
            print(f"| {model} | {one:,.0f} | {best} | {best_rate:,.0f} |")

    if load_rows:
        print(f"\n### Closed loop, {args.clients} concurrent clients: naive Celery task per request (clients call"
              " Celery directly; and behind a REST endpoint, benchmarks/naive_rest.py) vs SITS through REST\n")
        print("| model | naive req/s | naive REST req/s | naive REST p50 / p99 ms | SITS req/s | SITS p50 / p99 ms |"
              " SITS mean batch | SITS / naive | SITS / naive REST | errors (naive/naive REST/SITS) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for model, naive, naive_rest, sits in load_rows:
            spread: tuple[str, ...] = ("", "", "")
            if repeats > 1:
                spread = tuple(f" ({run['rps_range'][0]:,.0f}–{run['rps_range'][1]:,.0f})"
                               for run in (naive, naive_rest, sits))
            print(f"| {model} | {naive['rps']:,.0f}{spread[0]} | {naive_rest['rps']:,.0f}{spread[1]} |"
                  f" {naive_rest['p50']:.1f} / {naive_rest['p99']:.1f} | {sits['rps']:,.0f}{spread[2]} |"
                  f" {sits['p50']:.1f} / {sits['p99']:.1f} | {sits['mean_batch']:.1f} |"
                  f" {sits['rps'] / naive['rps']:.2f} | {sits['rps'] / naive_rest['rps']:.2f} |"
                  f" {naive['errors']}/{naive_rest['errors']}/{sits['errors']} |")
        if repeats > 1:
            print("\n(req/s: median run, with the range over the runs in brackets)")

        print("\n### Where the CPU went: CPU ms per request, by process, in the median run\n")
        names = [name for name in load_rows[0][1]["cpu"] if "beat" not in name]
        print("| model | side | " + " | ".join(names) + " | total | cores busy (of 2) |")
        print("| --- | --- | " + " | ".join("---:" for _ in names) + " | ---: | ---: |")
        for model, naive, naive_rest, sits in load_rows:
            for side, run in (("naive", naive), ("naive REST", naive_rest), ("SITS", sits)):
                per = [run["cpu"].get(name, 0.0) * 1000 / max(run["done"], 1) for name in names]
                busy = sum(run["cpu"].values()) / run["elapsed"]
                print(f"| {model} | {side} | " + " | ".join(f"{value:.2f}" for value in per)
                      + f" | {sum(per):.2f} | {busy:.2f} |")

    if floors:
        print("\n### The REST floor: the same clients against a Flask app under the same gunicorn settings that only"
              " parses each request and answers (benchmarks/rest_floor.py: no model, no Redis)\n")
        print("| model (payload) | REST floor req/s | API CPU ms per request | clients CPU ms per request |"
              " SITS req/s | SITS / floor | naive req/s | floor / naive |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for model, naive, _, sits in load_rows:
            if model not in floors:
                continue
            floor = floors[model]
            floor_cpu = {name: value * 1000 / max(floor["done"], 1) for name, value in floor["cpu"].items()}
            print(f"| {model} | {floor['rps']:,.0f} | {floor_cpu.get('SITS api', 0.0):.2f} |"
                  f" {floor_cpu.get('clients (bench)', 0.0):.2f} | {sits['rps']:,.0f} |"
                  f" {sits['rps'] / floor['rps']:.2f} | {naive['rps']:,.0f} | {floor['rps'] / naive['rps']:.2f} |")

    if idle:
        print(f"\n### Idle latency: one client, {idle_count} sequential one-row MLP requests (20 ms apart),"
              " wait=true\n")
        print("| ok | client p50 ms | client p99 ms | server p50 ms | server p99 ms |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        print(f"| {idle['ok']}/{idle['count']} | {idle['p50']:.1f} | {idle['p99']:.1f} | {idle['server_p50']:.1f} |"
              f" {idle['server_p99']:.1f} |")

    if phases:
        print("\n### Dynamic priority vs FIFO: the model registered again under `<model>_b<N>` with max_batch_size N;"
              f" 12 free clients (priority 0) keep up to {args.backlog} requests waiting (submitted without wait),"
              " 4 vip clients (priority 8) wait for each answer; base64 .npy inputs; latency = created to finished"
              " in the server's record (vip client-side P99 in brackets); waiting = mean ready-queue depth\n")
        print("| model | max batch | ordering | waiting | req/s | mean batch | vip n | vip p50 ms | vip P99 ms |"
              " free n | free p50 ms | free P99 ms | free longest ms | errors/unfinished |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for phase in phases:
            print(f"| {phase['model']} | {phase['batch']} | {phase['ordering']} | {phase['depth']:.0f} |"
                  f" {phase['rps']:,.0f} | {phase['mean_batch']:.1f} | {phase['vip_n']} | {phase['vip_p50']:.1f} |"
                  f" {phase['vip_p99']:.1f} ({phase['vip_client_p99']:.1f}) | {phase['free_n']} |"
                  f" {phase['free_p50']:.1f} | {phase['free_p99']:.1f} | {phase['free_max']:.1f} |"
                  f" {phase['errors']}/{phase['free_unfinished']} |")
        print()
        for case in dict.fromkeys((phase["model"], phase["batch"]) for phase in phases):
            fifo = [p["vip_p99"] for p in phases if p["ordering"] == "fifo" and (p["model"], p["batch"]) == case]
            dynamic = [p["vip_p99"] for p in phases if p["ordering"] == "dynamic" and (p["model"], p["batch"]) == case]
            print(f"{case[0]}, max batch {case[1]}: vip P99 dynamic/FIFO ="
                  f" {float(np.median(dynamic)) / float(np.median(fifo)):.2f} (medians over {len(dynamic)} run(s)"
                  " each; target <= 0.25)  ")


if __name__ == "__main__":
    main()


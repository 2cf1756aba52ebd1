"""SITS against other serving systems: mosec, LitServe, Ray Serve and Triton online, Ray Data offline.

    python3 -m venv .venv && .venv/bin/pip install -e '.[cpu,bench]'   # the peers are in the bench extra
    python benchmarks/peers.py --quick        # 3 s per point, 1 round, 1 and 32 clients: about 8 minutes
    python benchmarks/peers.py                # 15 s per point, 3 rounds, 1/8/32/128 clients: about 2 hours
    python benchmarks/peers.py --json peers.json --chart docs/img/peers.png
    python benchmarks/peers.py --quick --systems sits,mosec --models convnet --concurrency 1,32 --parts online
    python benchmarks/peers.py --systems sits,triton --concurrency 1,32 --rounds 1 --parts online \
        --pytriton-python /work/pytriton-venv/bin/python

(The peers pull in Ray, pyarrow and pandas: keep them out of the project's own environment by using a
second one, e.g. `python3 -m venv /work/bench-venv && /work/bench-venv/bin/pip install -e '.[cpu,bench]'`
and `/work/bench-venv/bin/python benchmarks/peers.py --quick`.)

(Triton needs numpy < 2, so it runs from an environment of its own, named by `--pytriton-python` or
`$PEER_PYTRITON_PYTHON`: `python3 -m venv /work/pytriton-venv && /work/pytriton-venv/bin/pip install
'nvidia-pytriton==0.7.0' 'numpy<2' onnxruntime`. Its server script imports SITS's session options from
this checkout, which load under numpy < 2. Without it the default `--systems` leave `triton` out.)

Systems (`--systems`), each on loopback with one replica per model, started and stopped by this script
(by PID: every process of its tree or session), one at a time, in an order that rotates every round:

- `sits`: the stack as `sitsctl up` runs it (`sits_api/cli/stack.py`: embedded Redis, the API under
  gunicorn, 1 worker) with the default settings (4 stream slots; batching `auto`, which is max batch 64
  and no delay for a model registered without a measured profile), except ONNX Runtime's threads;
- `sits-tuned`: the same with 1 stream slot, online batching `max_batch_size` 32, `max_queue_delay`
  5 ms (the batching every peer gets), and the API under granian (`api.server: granian`);
- `mosec` 0.9.8 (`peer_servers/mosec_server.py`): its Rust front and one Python worker per model,
  `max_batch_size=32`, `max_wait_time=5` ms, `--timeout 30000` (30 s, as LitServe's; mosec's own is 3 s);
- `litserve` 0.2.19 (`peer_servers/litserve_server.py`): one LitAPI per model (`max_batch_size=32`,
  `batch_timeout=0.005`), one inference worker each, LitServe's default uvicorn API servers, timeout 30 s;
- `ray` Serve 2.60 (`peer_servers/ray_server.py`): one application per model, 1 replica,
  `@serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)`, `max_ongoing_requests=256` (Ray's
  default of 5 would cap each batch at 5), Serve logging at WARNING without access logs (as quiet as
  the others), Ray started by the script with 2 CPUs and no dashboard;
- `triton`: Triton Inference Server through nvidia-pytriton 0.7.0 (`peer_servers/triton_server.py`): its
  bundled `tritonserver` (HTTP and gRPC on loopback), one Python-backend instance per model, whose stub
  hands each batch to the pytriton process; `@batch` joins the rows for one `session.run` there;
  `max_batch_size` 32, dynamic batching with a 5 ms `max_queue_delay`; no metrics port. The Python
  backend stub links against libpython: the script puts its interpreter's `lib` folder (sysconfig
  `LIBDIR`) on `LD_LIBRARY_PATH` before Triton starts.

What is held equal, to run each peer fairly:

- the models: the zoo's `mlp` (input `features` [N, 64]) and `convnet` (`pixels` [N, 3, 32, 32]), output
  `logits` [N, 10], built by `sits_worker.model.zoo.build_zoo` into a temporary folder;
- ONNX Runtime: every peer, the bare loops and the reference answers build their sessions with SITS's
  own `sits_worker.device.runtime.session_options(2)` (graph optimisation ORT_ENABLE_ALL, 2 intra-op threads,
  intra-op spin 100 us; `peer_servers/_common.py` and `triton_server.py` import it), CPU provider; SITS gets
  `resources.intra_op_threads: 2` (its default, 0, lets ONNX Runtime choose);
- a batch of requests is one `session.run` over their rows, concatenated, on every system;
- the load: one closed-loop generator for all (`benchmarks/online_serving.py`'s `closed_loop`), one row
  per request, the same 256 inputs per model, each request's bytes (HTTP/1.1 head and body) encoded once
  before the runs and sent on a keep-alive socket, one per client thread (a lean client: with
  `http.client` the generator itself capped the fast peers near 900 req/s); a short unmeasured warm-up
  before each point;
- the payloads: JSON `{"inputs": <nested lists>}` (SITS: its own route, `POST /v1/requests` with
  `{"model", "inputs": {<input>: <nested lists>}, "wait": true}`); binary: SITS takes the v2 binary
  tensor extension exactly as tritonclient frames it (`POST /v2/models/<m>/infer`, JSON header, raw
  FP32 bytes, `Inference-Header-Content-Length`, `binary_data_output`), mosec and Ray a raw float32 body
  answered by raw float32; LitServe has no binary run (its handler always calls `request.json()`);
  Triton takes the same v2 binary bodies as SITS, and v2 JSON tensors (`"data"`, flat) for its JSON run;
- gRPC (`--formats grpc`, SITS and Triton only): the KServe v2 protocol (`ModelInfer`) with
  `tritonclient.grpc`, raw contents, each request's `InferInput` built once before the runs, one
  `InferenceServerClient` per client thread; SITS at the `grpc_address` of its `GET /v1/status` with its
  key in the `authorization` metadata;
- JSON: the mosec and Ray handlers parse and write it with orjson (SITS's own JSON library); LitServe
  parses with its own `await request.json()` (the standard library's) and writes its `encode_response`
  dict itself;
- answers: every answer is checked against a direct ONNX Runtime run of the same row with the same
  options (`np.allclose`, rtol 1e-4, atol 1e-5); wrong answers are counted apart from errors;
- CPU per request: the CPU seconds (from /proc) of every process of the system during the run (SITS:
  API master and gunicorn workers, the Celery worker, Redis; mosec: the Python parent, its Rust front and
  workers; LitServe: parent, uvicorn and inference workers; Ray: the driver, GCS, raylet, agents, Serve
  controller, proxy, replicas; SITS over gRPC: its gRPC server in place of the API; Triton: the pytriton
  process, which runs the models, `tritonserver`, the Python backend stubs and their helpers) over the
  requests served; the client's own CPU is left out (shown apart):
  the clients share the 2 cores with the servers.

The mosec patch: mosec 0.9.8's Python worker (`mosec/protocol.py`, `Protocol.receive`) reads the IPC
fields around each payload (flag, batch size, each task's id, state and length) with one bare
`socket.recv(n)`, which may return fewer than n bytes; then it reads the rest of the frame out of step,
and a whole batch fails. This was reported to fail every CNN request at 32 clients (batches of about
1 MB of JSON). `peer_servers/mosec_server.py` replaces `Protocol.receive` at runtime with one that
reads every field in full (looping until the announced length is read), in the server and in every
worker it spawns, and says so when it starts; site-packages is untouched. On the 2-core machine of
2026-12-01 the failure did not show unpatched (`PEER_MOSEC_UNPATCHED=1`: 0 errors in about 80,000 CNN
requests at 32 and 128 clients, JSON and binary), so there the patch changes nothing measured; it stays,
as it only differs from the original when a read comes back short.

Offline (`--parts offline`): for each model, the bare ONNX Runtime loop (`offline_job.bare_loop`,
with SITS's session options) picks its best batch from 1, 8, 32, 128, 512, 2,048 (those that fit 4
times in the rows swept); then, alternating each round: the bare loop at that batch, a SITS job
(`offline_job.system_run` with the server's `auto` batch and chunk sizes, model registered with
`profile_mode: full`) on the `sits` and `sits-tuned` stacks, and Ray Data (`peer_servers/ray_offline.py`:
`read_numpy` -> `map_batches` with one actor at the bare loop's best batch -> `write_numpy`, timed from
execution start to the last output written). Rows/s, medians. Ray Data starts a new actor (a worker
process that builds the session) for every execution, so its start-up is in its figure; `ray after
start-up` takes out a run over one batch, timed after the others. A SITS job's figure runs from its
first lease on a warm worker.

Before every load point the script waits while a test suite runs on the machine (`python -m pytest`
or `bash .ci/run` in a command line): the 2 cores are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.offline_job import CASES, SWEEP_ROWS, _register, bare_loop, system_run  # noqa: E402
from benchmarks.online_serving import INPUTS, closed_loop  # noqa: E402
from broker.config.settings import Settings  # noqa: E402
from broker.state.embedded import free_port  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.device.runtime import session_options  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

SERVERS = ROOT / "benchmarks" / "peer_servers"
SYSTEMS = ("sits", "sits-tuned", "mosec", "litserve", "ray", "triton")
FORMATS = ("json", "binary", "grpc")
FORMATS_OF = {"sits": FORMATS, "sits-tuned": FORMATS, "mosec": ("json", "binary"), "litserve": ("json",),
              "ray": ("json", "binary"), "triton": FORMATS}
"""The payloads each system takes: LitServe has no binary run, only SITS and Triton speak gRPC."""
MODELS = ("mlp", "convnet")
ORT_THREADS = 2
BATCH, WAIT_SECONDS = 32, 0.005  # every system's dynamic batching but plain `sits`
PAYLOADS = 256  # distinct one-row inputs per model
RTOL, ATOL = 1e-4, 1e-5
OFFLINE_SWEEP = (1, 8, 32, 128, 512, 2048)
BUSY_MARKERS = ("python -m pytest", "bash .ci/run")
START_TIMEOUT = 240.0  # seconds for a system to answer its first request (Ray takes about 30 s)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- the machine ---------------------------------------------------------------------------------


def busy_with() -> str | None:
    """The command line of a test suite running on this machine, if one is (not counting this process,
    its ancestors, such as a shell whose command line names the markers, or a pgrep or grep for them)."""
    mine, pid = set(), os.getpid()
    while pid > 1 and pid not in mine:
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name in ("pgrep", "grep", "pkill"):
            continue
        cmdline = b" ".join(argv).decode(errors="replace")
        if any(marker in cmdline for marker in BUSY_MARKERS):
            return cmdline.strip()[:120]
    return None


def wait_until_quiet(limit: float) -> None:
    """Sleep while a test suite runs (the cores are shared); give up after `limit` seconds."""
    deadline = time.monotonic() + limit
    while (suite := busy_with()) is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"a test suite still runs after {limit:.0f} s ({suite}); try again later")
        log(f"a test suite runs ({suite}); waiting 20 s")
        time.sleep(20)


def process_table() -> dict[int, tuple[int, int, int, float, str]]:
    """pid: (ppid, session, start time in ticks, CPU seconds, name) of every process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        fields = text[text.rfind(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[19]),
                                  (int(fields[11]) + int(fields[12])) / tick, name)
    return table


class TreeCpuMeter:
    """CPU seconds of a system's processes between `start` and `stop`, by process name.

    Its processes: the roots, everything descended from them, and everything in the session of a root
    that leads one (Ray's and LitServe's children; a worker that outlived a parent that died). A process
    that starts during the run counts in full; one that ends during it loses its last interval.
    """

    def __init__(self, roots: list[int]) -> None:
        self.roots = [pid for pid in roots if pid]
        self.before: dict[tuple[int, int], float] = {}

    def members(self, table: dict[int, tuple[int, int, int, float, str]]) -> set[int]:
        sessions = {pid for pid in self.roots if pid in table and table[pid][1] == pid}
        found = {pid for pid, row in table.items() if pid in self.roots or row[1] in sessions}
        children: dict[int, list[int]] = {}
        for pid, row in table.items():
            children.setdefault(row[0], []).append(pid)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        return found

    def start(self) -> None:
        table = process_table()
        self.before = {(pid, table[pid][2]): table[pid][3] for pid in self.members(table)}

    def stop(self) -> dict[str, float]:
        table = process_table()
        used: dict[str, float] = {}
        for pid in self.members(table):
            _, _, started, cpu, name = table[pid]
            label = process_label(pid, name)
            used[label] = used.get(label, 0.0) + cpu - self.before.get((pid, started), 0.0)
        return used

    def pids(self) -> set[int]:
        return self.members(process_table())


def process_label(pid: int, name: str) -> str:
    """A Python process by what it runs (`-m gunicorn`, `mosec_server.py`, a multiprocessing child), else its name."""
    if not name.startswith("python"):
        return name
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return name
    for index, arg in enumerate(argv[1:], 1):
        if arg == "-m" and index + 1 < len(argv):
            return argv[index + 1]
        if arg == "-c" and index + 1 < len(argv):
            return "multiprocessing child" if "multiprocessing" in argv[index + 1] else "python -c"
        if arg.endswith(".py"):
            return Path(arg).name
    return name


def stop_tree(meter: TreeCpuMeter, root: subprocess.Popen[bytes] | None, grace: float = 30.0) -> None:
    """Stop a peer: SIGTERM its root and wait; then SIGTERM, and SIGKILL after 5 s, whatever of its tree
    or session is left, each by its PID."""
    left = meter.pids()
    if root is not None and root.poll() is None:
        root.send_signal(signal.SIGTERM)
        try:
            root.wait(grace)
        except subprocess.TimeoutExpired:
            root.kill()
            root.wait()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(left):
        time.sleep(0.2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = _alive(left | meter.pids())
        if not live:
            return
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        time.sleep(5)


def _alive(pids: set[int]) -> set[int]:
    """The pids still running (zombies, which only wait to be reaped, are not)."""
    live = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            live.add(pid)
    return live


# --- payloads and answers ---------------------------------------------------------------------------


@dataclass
class Inputs:
    """A model's one-row inputs and the direct ONNX Runtime answer of each."""

    model: str
    arrays: list[np.ndarray]
    expected: list[np.ndarray]


def make_inputs(model: str, path: Path, count: int = PAYLOADS) -> Inputs:
    name, shape = INPUTS[model]
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((1, *shape), dtype=np.float32) for _ in range(count)]
    session = ort.InferenceSession(str(path), session_options(ORT_THREADS), providers=["CPUExecutionProvider"])
    expected = [session.run(["logits"], {name: array})[0] for array in arrays]
    return Inputs(model, arrays, expected)


class RawHttp:
    """One HTTP/1.1 keep-alive connection to 127.0.0.1:port, sending requests encoded in full beforehand.

    `http.client` costs the client about 1 ms of CPU per request, and the client threads share the
    GIL: at about 900 req/s the generator, not the server, was the limit. This one sends prepared
    bytes and reads the answer with a buffered reader (status line, headers, a Content-Length or
    chunked body), several times cheaper, so the fast peers are not held to the client's pace.
    """

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self.port, self.timeout = port, timeout
        self.sock: socket.socket | None = None
        self.file: Any = None

    def exchange(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        for attempt in range(2):  # one reconnect: a server may close an idle keep-alive connection
            if self.sock is None:
                self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.file = self.sock.makefile("rb", buffering=65536)
            try:
                self.sock.sendall(request)
                status, headers, body = self._read()
                if headers.get("connection", "").lower() == "close":
                    self.close()
                return status, headers, body
            except (OSError, ValueError, IndexError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _read(self) -> tuple[int, dict[str, str], bytes]:
        line = self.file.readline(65537)
        if not line:
            raise ConnectionError("the server closed the connection")
        status = int(line.split(None, 2)[1])
        headers: dict[str, str] = {}
        while (line := self.file.readline(65537)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = self.file.read(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while (size := int(self.file.readline(65537).split(b";")[0], 16)):
                parts.append(self.file.read(size))
                self.file.readline(65537)
            while self.file.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            body = b"".join(parts)
        else:
            body = self.file.read()
            headers["connection"] = "close"
        return status, headers, body

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.file.close()
                self.sock.close()
            self.sock = self.file = None


@dataclass
class Route:
    """How one system takes one model's requests in one format: each request's bytes, in full."""

    path: str
    headers: dict[str, str]
    bodies: list[bytes]
    parse: Callable[[dict[str, str], bytes], np.ndarray]
    requests: list[bytes] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    """The batch each answer says it ran in, where the answer says (SITS's v1 route)."""

    port: int = 0

    def prepare(self, port: int) -> Route:
        lines = [f"POST {self.path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
                 *(f"{name}: {value}" for name, value in self.headers.items())]
        self.requests = [("\r\n".join([*lines, f"Content-Length: {len(body)}", "", ""])).encode("latin-1") + body
                         for body in self.bodies]
        self.port = port
        return self

    def open(self) -> HttpCaller:
        """One client's connection: a call sends request k and returns its answer's outputs."""
        return HttpCaller(self)


class HttpCaller:
    """One client thread's keep-alive connection for a Route: request k in, its checked outputs out."""

    def __init__(self, route: Route) -> None:
        self.route, self.http = route, RawHttp(route.port)

    def __call__(self, k: int) -> np.ndarray:
        status, headers, raw = self.http.exchange(self.route.requests[k])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {raw[:200]!r}")
        return self.route.parse(headers, raw)

    def close(self) -> None:
        self.http.close()


class GrpcRoute:
    """One model's requests over the KServe v2 gRPC protocol, sent with `tritonclient.grpc` (raw contents).

    Each request's input tensor is built once, before the runs, as the HTTP requests are encoded once;
    each client thread has its own `InferenceServerClient`. `prepare` changes nothing: the address is
    given here, as the HTTP port is not the gRPC one.
    """

    def __init__(self, address: str, inputs: Inputs, headers: dict[str, str]) -> None:
        self.address, self.model, self.headers = address, inputs.model, headers
        self.tensors = []
        for array in inputs.arrays:
            tensor = grpcclient.InferInput(INPUTS[inputs.model][0], list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            self.tensors.append(tensor)
        self.bodies = self.tensors
        self.batches: list[int] = []

    def prepare(self, port: int) -> GrpcRoute:
        return self

    def open(self) -> GrpcCaller:
        return GrpcCaller(self)


class GrpcCaller:
    """One client thread's `tritonclient.grpc.InferenceServerClient` for a GrpcRoute."""

    def __init__(self, route: GrpcRoute) -> None:
        self.route, self.client = route, grpcclient.InferenceServerClient(route.address)

    def __call__(self, k: int) -> np.ndarray:
        answer = self.client.infer(self.route.model, [self.route.tensors[k]], headers=self.route.headers,
                                   client_timeout=60.0)
        return answer.as_numpy("logits")

    def close(self) -> None:
        self.client.close()


def sits_route(key: str, grpc_address: str, inputs: Inputs, fmt: str) -> Route | GrpcRoute:
    name = INPUTS[inputs.model][0]
    auth = {"Authorization": f"Bearer {key}"}
    if fmt == "grpc":
        return GrpcRoute(grpc_address, inputs, {"authorization": f"Bearer {key}"})
    if fmt == "binary":
        return v2_binary_route(inputs, auth)
    if fmt == "json":
        def parse_json(headers: dict[str, str], raw: bytes) -> np.ndarray:
            body = json.loads(raw)
            if body.get("status") != "succeeded":
                raise RuntimeError(f"request {body.get('id')} {body.get('status')}: {body.get('error')}")
            route.batches.append(int(body["batch_size"]))
            return np.asarray(body["outputs"]["logits"], dtype=np.float32)

        bodies = [json.dumps({"model": inputs.model, "inputs": {name: array.tolist()}, "wait": True}).encode()
                  for array in inputs.arrays]
        route = Route("/v1/requests", auth | {"Content-Type": "application/json"}, bodies, parse_json)
        return route
    raise ValueError(fmt)


def parse_v2(headers: dict[str, str], raw: bytes) -> np.ndarray:
    """The first output of a v2 answer: JSON `data`, or raw bytes after `Inference-Header-Content-Length`."""
    length = int(headers.get("inference-header-content-length") or len(raw))
    output = json.loads(raw[:length])["outputs"][0]
    if "data" in output:
        return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
    return np.frombuffer(raw[length:], dtype="<f4").reshape(output["shape"])


def v2_binary_route(inputs: Inputs, auth: dict[str, str]) -> Route:
    """`POST /v2/models/<m>/infer` with the binary tensor extension, framed as tritonclient frames it."""
    name = INPUTS[inputs.model][0]

    def framed(array: np.ndarray) -> tuple[bytes, int]:  # as tritonclient's InferenceServerClient.infer sends it
        raw = array.astype("<f4").tobytes()
        header = json.dumps({"inputs": [{"name": name, "shape": list(array.shape), "datatype": "FP32",
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "parameters": {"binary_data_output": True}}).encode()
        return header + raw, len(header)

    frames = [framed(array) for array in inputs.arrays]
    # Every body's JSON header has one length (same shapes), so one set of headers serves them all.
    lengths = {length for _, length in frames}
    assert len(lengths) == 1
    headers = auth | {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(*lengths)}
    return Route(f"/v2/models/{inputs.model}/infer", headers, [body for body, _ in frames], parse_v2)


def triton_route(grpc_port: int, inputs: Inputs, fmt: str) -> Route | GrpcRoute:
    """Triton's v2 routes: JSON tensors (`data`), the binary extension as SITS takes it, or gRPC."""
    if fmt == "grpc":
        return GrpcRoute(f"127.0.0.1:{grpc_port}", inputs, {})
    if fmt == "binary":
        return v2_binary_route(inputs, {})
    name = INPUTS[inputs.model][0]
    bodies = [json.dumps({"inputs": [{"name": name, "shape": list(array.shape), "datatype": "FP32",
                                      "data": array.ravel().tolist()}]}).encode() for array in inputs.arrays]
    return Route(f"/v2/models/{inputs.model}/infer", {"Content-Type": "application/json"}, bodies, parse_v2)


def peer_route(inputs: Inputs, fmt: str) -> Route:
    if fmt == "json":
        bodies = [json.dumps({"inputs": array.tolist()}).encode() for array in inputs.arrays]
        return Route(f"/{inputs.model}", {"Content-Type": "application/json"}, bodies,
                     lambda headers, raw: np.asarray(json.loads(raw)["outputs"], dtype=np.float32))
    bodies = [array.astype("<f4").tobytes() for array in inputs.arrays]
    return Route(f"/{inputs.model}", {"Content-Type": "application/octet-stream"}, bodies,
                 lambda headers, raw: np.frombuffer(raw, dtype="<f4").reshape(-1, 10))


# --- the systems -------------------------------------------------------------------------------------


@dataclass
class Running:
    """A started system: its port, its processes' meter, how to stop it, how to reach each model."""

    name: str
    port: int
    meter: TreeCpuMeter
    stop: Callable[[], None]
    route: Callable[[Inputs, str], Route | GrpcRoute]
    stack: Stack | None = None
    notes: list[str] = field(default_factory=list)


def sits_settings(home: Path, tuned: bool) -> Settings:
    """`sits` or `sits-tuned` in `home`; models, inputs and outputs anywhere in the run's folder (its parent)."""
    roots = (home.parent,)
    overrides: dict[str, Any] = {
        "paths": {"home": home, "model_roots": roots, "input_roots": roots, "output_roots": roots},
        "resources": {"intra_op_threads": ORT_THREADS} | ({"max_concurrent_streams": 1} if tuned else {}),
    }
    if tuned:
        overrides["online"] = {"batching": {"max_batch_size": BATCH, "max_queue_delay": WAIT_SECONDS}}
        overrides["api"] = {"server": "granian"}
    return Settings().with_overrides(**overrides)


def start_sits(name: str, home: Path, zoo: dict[str, Path], models: list[str], *, profile_mode: str = "static",
               ) -> Running:
    tuned = name == "sits-tuned"
    stack = Stack(sits_settings(home, tuned), worker_count=1, api_port=0)
    stack.start()
    try:
        for model in models:
            _register(stack, model, zoo[model], profile_mode)
        batching = {model: stack.client().get(f"/v1/models/{model}")["batching"] for model in models}
    except BaseException:
        stack.stop()
        raise
    redis_pid = stack.redis.process.pid if stack.redis and stack.redis.process else 0
    meter = TreeCpuMeter([redis_pid, *(child.process.pid for child in stack.children)])
    # The live worker's stream slots, as it fitted them to its cores (its heartbeat), not the configured most.
    status = stack.client().get("/v1/status")
    workers = status.get("workers") or []
    streams = ", ".join(str(worker.get("streams")) for worker in workers) or "?"
    grpc_address = status.get("grpc_address") or ""
    return Running(name, int(stack.api_url.rsplit(":", 1)[1]), meter, stack.stop,
                   lambda inputs, fmt: sits_route(stack.api_key, grpc_address, inputs, fmt), stack=stack,
                   notes=[f"{name}: {streams} stream(s), batching {batching}, gRPC at {grpc_address or 'none'}"])


def start_peer(name: str, home: Path, zoo: dict[str, Path], models: list[str], pytriton_python: str | None = None,
               ) -> Running:
    port = free_port("127.0.0.1")
    spec = ",".join(f"{model}={zoo[model]}" for model in models)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SERVERS), str(ROOT), os.environ.get("PYTHONPATH")])))
    python = sys.executable
    route: Callable[[Inputs, str], Route | GrpcRoute] = peer_route
    if name == "mosec":
        env["PEER_MODELS"] = spec
        argv = [str(SERVERS / "mosec_server.py"), "--address", "127.0.0.1", "--port", str(port),
                "--timeout", "30000", "--log-level", "warning", "--path", str(home / "mosec-ipc")]
    elif name == "litserve":
        argv = [str(SERVERS / "litserve_server.py"), "--port", str(port), "--models", spec]
    elif name == "ray":
        argv = [str(SERVERS / "ray_server.py"), "--port", str(port), "--temp-dir", str(short_temp("sits-rs-")),
                "--models", spec]
    elif name == "triton":
        if not pytriton_python:
            raise SystemExit("triton runs from an environment of its own (pytriton needs numpy < 2): give "
                             "--pytriton-python or PEER_PYTRITON_PYTHON, e.g. /work/pytriton-venv/bin/python")
        grpc_port = port
        while grpc_port == port:
            grpc_port = free_port("127.0.0.1")
        python, route = pytriton_python, (lambda inputs, fmt: triton_route(grpc_port, inputs, fmt))
        argv = [str(SERVERS / "triton_server.py"), "--http-port", str(port), "--grpc-port", str(grpc_port),
                "--models", spec, "--workspace", str(home / "pytriton")]
    else:
        raise ValueError(name)
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / f"{name}.log"
    with open(log_path, "ab") as out:
        process = subprocess.Popen([python, *argv], cwd=home, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    meter = TreeCpuMeter([process.pid])
    running = Running(name, port, meter, lambda: stop_tree(meter, process), route)
    try:
        wait_ready(running, models, zoo, process, log_path)
    except BaseException:
        running.stop()
        raise
    text = log_path.read_text(errors="replace")
    running.notes += [line.split("] ", 1)[-1] for line in text.splitlines() if line.startswith("[peer ")]
    return running


def wait_ready(running: Running, models: list[str], zoo: dict[str, Path], process: subprocess.Popen[bytes],
               log_path: Path) -> None:
    """Until every model answers one request in each of the system's formats (sessions loaded, routes up)."""
    deadline = time.monotonic() + START_TIMEOUT
    for model in models:
        for fmt in FORMATS_OF[running.name]:
            caller = running.route(make_inputs(model, zoo[model], 1), fmt).prepare(running.port).open()
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{running.name} exited with {process.returncode}; log {log_path}:\n"
                                       f"{log_path.read_text(errors='replace')[-2000:]}")
                try:
                    caller(0)
                    break
                except Exception:  # not up yet: refused, 404 or 503 while the models load  # noqa: BLE001
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{running.name} did not answer in {START_TIMEOUT:.0f} s; log {log_path}")
                time.sleep(0.5)
            caller.close()


def start_system(name: str, home: Path, zoo: dict[str, Path], models: list[str], pytriton_python: str | None = None,
                 ) -> Running:
    if name.startswith("sits"):
        return start_sits(name, home, zoo, models)
    return start_peer(name, home, zoo, models, pytriton_python)


# --- load ----------------------------------------------------------------------------------------------


class WithClient:
    """A system's meter that also reads this process's own CPU (the client threads), under KEY."""

    KEY = "(client)"

    def __init__(self, meter: TreeCpuMeter) -> None:
        self.meter = meter
        self.client = 0.0

    def start(self) -> None:
        self.meter.start()
        self.client = _own_cpu()

    def stop(self) -> dict[str, float]:
        client = _own_cpu() - self.client
        return self.meter.stop() | {self.KEY: client}


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def load_point(running: Running, route: Route | GrpcRoute, inputs: Inputs, clients: int, seconds: float,
               warm_seconds: float) -> dict[str, Any]:
    """Closed loop of `clients` threads for `seconds` (after an unmeasured warm-up); every answer checked."""
    connections: list[HttpCaller | GrpcCaller] = []
    first_errors: list[str] = []
    lock = threading.Lock()

    def make_call(index: int) -> Callable[[int], int]:
        caller = route.open()
        with lock:
            connections.append(caller)

        def call(n: int) -> int:
            k = (index * 7919 + n) % len(route.bodies)
            try:
                output = caller(k)
            except Exception as err:
                if len(first_errors) < 5:
                    with lock:
                        first_errors.append(f"{type(err).__name__}: {err}"[:300])
                raise
            expected = inputs.expected[k]
            return int(output.shape != expected.shape or not np.allclose(output, expected, rtol=RTOL, atol=ATOL))
        return call

    meter = WithClient(running.meter)
    try:
        if warm_seconds:
            closed_loop(clients, warm_seconds, make_call)
        first_errors.clear()
        route.batches.clear()
        result = closed_loop(clients, seconds, make_call, meter)  # type: ignore[arg-type]
    finally:
        for connection in connections:
            connection.close()
    wrong = sum(result.pop("extras"))
    cpu = result.pop("cpu")
    client = cpu.pop(WithClient.KEY)
    done = max(result["done"], 1)
    return {"done": result["done"], "errors": result["errors"], "wrong": wrong, "rps": result["rps"],
            "p50": result["p50"], "p99": result["p99"], "elapsed": result["elapsed"],
            "cpu_ms": sum(cpu.values()) * 1000 / done, "cores": sum(cpu.values()) / result["elapsed"],
            "client_cpu_ms": client * 1000 / done, "client_cores": client / result["elapsed"],
            "mean_batch": float(np.mean(route.batches)) if route.batches else None,
            "cpu_by": {name: round(value * 1000 / done, 3) for name, value in sorted(cpu.items(), key=lambda i: -i[1])
                       if value > 0.005},
            "first_errors": first_errors}


def online_round(args: argparse.Namespace, round_index: int, systems: list[str], home: Path,
                 zoo: dict[str, Path], inputs: dict[str, Inputs], points: list[dict[str, Any]],
                 notes: dict[str, list[str]]) -> None:
    shift = round_index % len(systems)
    for system in systems[shift:] + systems[:shift]:
        wait_until_quiet(args.max_wait)
        began = time.monotonic()
        running = start_system(system, home / f"{system}-r{round_index}", zoo, args.models, args.pytriton_python)
        log(f"round {round_index}: {system} up in {time.monotonic() - began:.0f} s")
        notes.setdefault(system, running.notes)
        try:
            for model in args.models:
                for fmt in args.formats:
                    if fmt not in FORMATS_OF[system]:
                        continue
                    route = running.route(inputs[model], fmt).prepare(running.port)
                    for clients in args.concurrency:
                        wait_until_quiet(args.max_wait)
                        point = load_point(running, route, inputs[model], clients, args.seconds, args.warm)
                        point |= {"round": round_index, "system": system, "model": model, "format": fmt,
                                  "clients": clients}
                        points.append(point)
                        log(f"  {system} {model} {fmt} c={clients}: {point['rps']:,.0f} req/s, p50"
                            f" {point['p50']:.1f} p99 {point['p99']:.1f} ms, CPU {point['cpu_ms']:.2f} ms/req,"
                            f" errors {point['errors']}, wrong {point['wrong']}"
                            + (f" {point['first_errors'][:1]}" if point["first_errors"] else ""))
        finally:
            began = time.monotonic()
            running.stop()
            log(f"round {round_index}: {system} stopped in {time.monotonic() - began:.0f} s")


def summarize(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, model, format, clients): medians over the rounds, errors and wrong summed."""
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for point in points:
        groups.setdefault((point["system"], point["model"], point["format"], point["clients"]), []).append(point)
    rows = []
    for (system, model, fmt, clients), runs in groups.items():
        rows.append({"system": system, "model": model, "format": fmt, "clients": clients, "rounds": len(runs),
                     "rps": statistics.median(r["rps"] for r in runs),
                     "rps_range": (min(r["rps"] for r in runs), max(r["rps"] for r in runs)),
                     "p50": statistics.median(r["p50"] for r in runs), "p99": statistics.median(r["p99"] for r in runs),
                     "cpu_ms": statistics.median(r["cpu_ms"] for r in runs),
                     "cores": statistics.median(r["cores"] for r in runs),
                     "client_cpu_ms": statistics.median(r["client_cpu_ms"] for r in runs),
                     "mean_batch": statistics.median(batches) if (batches := [r["mean_batch"] for r in runs
                                                                             if r["mean_batch"]]) else None,
                     "errors": sum(r["errors"] for r in runs), "wrong": sum(r["wrong"] for r in runs),
                     "done": sum(r["done"] for r in runs)})
    order = {name: i for i, name in enumerate(SYSTEMS)}
    return sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 9,
                                       FORMATS.index(r["format"]), order.get(r["system"], 9), r["clients"]))


def print_online(rows: list[dict[str, Any]], rounds: int) -> None:
    print("\n### Online: closed loop, one row per request\n")
    print("| model | payload | system | clients | req/s | P50 ms | P99 ms | CPU ms/req | cores busy |"
          " client CPU ms/req | mean batch | errors | wrong |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        spread = f" ({r['rps_range'][0]:,.0f}–{r['rps_range'][1]:,.0f})" if rounds > 1 else ""
        batch = f"{r['mean_batch']:.1f}" if r["mean_batch"] else ""
        print(f"| {r['model']} | {r['format']} | {r['system']} | {r['clients']} | {r['rps']:,.0f}{spread} |"
              f" {r['p50']:.1f} | {r['p99']:.1f} | {r['cpu_ms']:.2f} | {r['cores']:.2f} | {r['client_cpu_ms']:.2f} |"
              f" {batch} | {r['errors']} | {r['wrong']} |")
    print("\n(CPU ms/req and cores busy: the system's processes only; the client's own CPU, on the same 2 cores,"
          " apart; mean batch: as SITS's v1 answers report it)")
    if rounds > 1:
        print(f"\n(medians of {rounds} rounds; req/s range in brackets; errors and wrong answers summed)")


# --- offline ------------------------------------------------------------------------------------------


def offline(args: argparse.Namespace, home: Path, zoo: dict[str, Path]) -> list[dict[str, Any]]:
    """Bare loop at its best batch vs SITS jobs vs Ray Data, alternating; rows/s per model."""
    sits_systems = [name for name in args.systems if name.startswith("sits")]
    rng = np.random.default_rng(0)
    data: dict[str, tuple[Path, int, int]] = {}
    for model in args.models:
        rows = int(CASES[model][1 if args.quick else 0] * args.rows_scale)
        inputs = CASES[model][4](rng, rows)
        path = home / f"offline-{model}.npy"
        np.save(path, inputs)
        wait_until_quiet(args.max_wait)
        sweep_rows = min(rows, SWEEP_ROWS[model])
        sizes_swept = [batch for batch in OFFLINE_SWEEP if 4 * batch <= sweep_rows] or [1]  # 4 runs at least
        sweep = {batch: bare_loop(zoo[model], inputs[:sweep_rows], batch, ORT_THREADS) for batch in sizes_swept}
        best = max(sweep, key=lambda b: sweep[b])
        log(f"offline {model}: bare sweep {({b: round(v) for b, v in sweep.items()})}, best batch {best}")
        data[model] = (path, rows, best)
        del inputs
    figures: dict[tuple[str, str], list[float]] = {}
    sizes: dict[tuple[str, str], tuple[int, int, int]] = {}  # a SITS job's batch, chunk and chunks
    stacks: dict[str, Running] = {}
    try:
        for name in sits_systems:
            stacks[name] = start_sits(name, home / f"offline-{name}", zoo, args.models, profile_mode="full")
        for model in args.models:
            path, rows, best = data[model]
            for name in sits_systems:  # warm-up job: session built, page cache
                system_run(stacks[name].stack, model, path, home / f"warm-{name}-{model}", None, None)  # type: ignore[arg-type]
            for round_index in range(args.rounds):
                wait_until_quiet(args.max_wait)
                inputs = np.load(path)
                figures.setdefault(("bare", model), []).append(bare_loop(zoo[model], inputs, best, ORT_THREADS))
                del inputs
                for name in sits_systems:
                    job = system_run(stacks[name].stack, model, path,  # type: ignore[arg-type]
                                     home / f"out-{name}-{model}-{round_index}", None, None)
                    figures.setdefault((name, model), []).append(
                        job["rows_total"] / (job["finished_at"] - job["started_at"]))
                    sizes[(name, model)] = (int(job["batch_size"]), int(job["chunk_size"]), int(job["chunks_total"]))
                if "ray" in args.systems:
                    ray_run = ray_data_run(zoo[model], path, best, home / f"ray-offline-{model}-{round_index}")
                    figures.setdefault(("ray", model), []).append(ray_run["rows_per_s"])
                    figures.setdefault(("ray after start-up", model), []).append(ray_run["after_start"])
                    figures.setdefault(("ray start-up s", model), []).append(ray_run["start_seconds"])
                log(f"offline {model} round {round_index}: " + ", ".join(
                    f"{name} {values[-1]:,.0f}" for (name, m), values in figures.items()
                    if m == model and not name.endswith(" s")) + " rows/s")
    finally:
        for running in stacks.values():
            running.stop()
    results = []
    for model in args.models:
        _, rows, best = data[model]
        entry: dict[str, Any] = {"model": model, "rows": rows, "bare_batch": best}
        for name in ("bare", *sits_systems, "ray", "ray after start-up", "ray start-up s"):
            if (name, model) in figures:
                entry[name] = statistics.median(figures[(name, model)])
            if (name, model) in sizes:
                entry[f"{name}_batch"], entry[f"{name}_chunk"], entry[f"{name}_chunks"] = sizes[(name, model)]
        results.append(entry)
    return results


def short_temp(prefix: str) -> Path:
    """A folder with a short path directly under /tmp, removed at the end of the run: Ray's Unix sockets
    lie under its temp folder, and their paths may not pass 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    SHORT_TEMPS.append(path)
    return path


SHORT_TEMPS: list[Path] = []


def ray_data_run(model_path: Path, source: Path, batch: int, out: Path) -> dict[str, Any]:
    """One Ray Data pass (peer_servers/ray_offline.py in its own process and Ray cluster): its rows/s, and
    its rows/s once the start-up of a run (timed on a few batches) is taken out."""
    temp = short_temp("sits-rd-")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "ab") as err:
        process = subprocess.Popen([sys.executable, str(SERVERS / "ray_offline.py"), "--model", str(model_path),
                                    "--input", str(source), "--batch", str(batch), "--out", str(out),
                                    "--temp-dir", str(temp)], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    meter = TreeCpuMeter([process.pid])
    try:
        stdout, _ = process.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        stop_tree(meter, process)
        raise RuntimeError(f"Ray Data took over 900 s; log {log_path}") from None
    finally:
        stop_tree(meter, None, grace=10)  # anything of its Ray that outlived the driver
    if process.returncode != 0:
        raise RuntimeError(f"Ray Data failed ({process.returncode}); log {log_path}:\n"
                           f"{log_path.read_text(errors='replace')[-2000:]}")
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    return {"rows_per_s": result["rows_per_s"][0], "after_start": result["rows_per_s_after_start"][0],
            "start_seconds": result["small_seconds"]}


def print_offline(results: list[dict[str, Any]], rounds: int, systems: list[str]) -> None:
    names = [name for name in ("bare", *systems, "ray", "ray after start-up")
             if any(name in entry for entry in results)]
    print(f"\n### Offline: rows/s, medians of {rounds} alternating round(s); ratio to the bare loop in brackets\n")
    print("| model | rows | bare batch | " + " | ".join(f"{name} rows/s" for name in names)
          + " | SITS job batch / chunk x chunks |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for entry in results:
        cells = []
        for name in names:
            value = entry.get(name)
            ratio = f" ({value / entry['bare']:.2f})" if value and name != "bare" and entry.get("bare") else ""
            cells.append(f"{value:,.0f}{ratio}" if value else "")
        chunks = ", ".join(f"{name}: {entry[f'{name}_batch']} / {entry[f'{name}_chunk']:,} x {entry[f'{name}_chunks']}"
                           for name in systems if f"{name}_batch" in entry)
        print(f"| {entry['model']} | {entry['rows']:,} | {entry['bare_batch']} | " + " | ".join(cells)
              + f" | {chunks} |")
    if any("ray start-up s" in entry for entry in results):
        print("\n(Ray Data starts a new actor pool, a worker process that builds the session, for every execution;"
              " `ray after start-up` takes out that start-up, timed as a run over one batch: "
              + ", ".join(f"{entry['model']} {entry['ray start-up s']:.1f} s" for entry in results
                          if "ray start-up s" in entry) + ")")


# --- chart ---------------------------------------------------------------------------------------------


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    """req/s and P99 against concurrency, one line per system and payload, one row of plots per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    colours = {name: f"C{i}" for i, name in enumerate(SYSTEMS)}
    for line, model in enumerate(models):
        for (system, fmt) in dict.fromkeys((r["system"], r["format"]) for r in rows if r["model"] == model):
            series = sorted((r for r in rows if (r["model"], r["system"], r["format"]) == (model, system, fmt)),
                            key=lambda r: r["clients"])
            xs = [r["clients"] for r in series]
            style = {"color": colours.get(system), "linestyle": {"json": "-", "binary": "--"}.get(fmt, ":"),
                     "marker": "o"}
            axes[line][0].plot(xs, [r["rps"] for r in series], label=f"{system} ({fmt})", **style)
            axes[line][1].plot(xs, [r["p99"] for r in series], label=f"{system} ({fmt})", **style)
        for column, (title, unit) in enumerate((("throughput", "req/s"), ("P99 latency", "ms"))):
            ax = axes[line][column]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            levels = sorted({r["clients"] for r in rows})
            ax.set_xticks(levels, [str(level) for level in levels])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(unit)
            ax.set_title(f"{model}: {title}")
            ax.grid(True, which="both", alpha=0.3)
        axes[line][0].legend(fontsize=8)
    figure.suptitle("SITS and peers on 2 CPU cores, one replica, one-row requests (solid JSON, dashed binary,"
                    " dotted gRPC)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- main -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s points, 1 round, 1 and 32 clients, smaller offline")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--concurrency", help="client counts (default 1,32 quick, 1,8,32,128 full)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="payloads: json, binary, grpc")
    parser.add_argument("--pytriton-python", default=os.environ.get("PEER_PYTRITON_PYTHON"),
                        help="the Python of an environment with nvidia-pytriton 0.7.0 and numpy < 2, for `triton`"
                             " (default $PEER_PYTRITON_PYTHON)")
    parser.add_argument("--parts", default="online,offline")
    parser.add_argument("--seconds", type=float, help="length of one load point (default 3 quick, 15 full)")
    parser.add_argument("--warm", type=float, help="unmeasured warm-up before each point (default 0.5 quick, 2 full)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 1 quick, 3 full)")
    parser.add_argument("--rows-scale", type=float, default=1.0, help="multiply the offline rows")
    parser.add_argument("--max-wait", type=float, default=3600.0, help="longest wait for a running test suite (s)")
    parser.add_argument("--json", type=Path, help="write every point and the summaries here")
    parser.add_argument("--chart", type=Path, help="write a PNG of req/s and P99 by concurrency here")
    args = parser.parse_args()
    if args.systems == parser.get_default("systems") and not args.pytriton_python:
        args.systems = ",".join(name for name in SYSTEMS if name != "triton")
        log("triton left out: no --pytriton-python (or $PEER_PYTRITON_PYTHON) given")
    args.systems = [name for name in args.systems.split(",") if name]
    if "triton" in args.systems and not args.pytriton_python:
        parser.error("triton needs --pytriton-python (or $PEER_PYTRITON_PYTHON): the Python of an environment"
                     " with nvidia-pytriton 0.7.0 and numpy < 2")
    args.models = [name for name in args.models.split(",") if name]
    args.formats = [name for name in args.formats.split(",") if name]
    parts = set(args.parts.split(","))
    for value, allowed, flag in ((args.systems, SYSTEMS, "--systems"), (args.models, MODELS, "--models"),
                                 (args.formats, FORMATS, "--formats"), (parts, ("online", "offline"), "--parts")):
        if not value or set(value) - set(allowed):
            parser.error(f"{flag} takes some of {', '.join(allowed)}")
    args.concurrency = [int(c) for c in (args.concurrency or ("1,32" if args.quick else "1,8,32,128")).split(",")]
    args.seconds = args.seconds or (3.0 if args.quick else 15.0)
    args.warm = args.warm if args.warm is not None else (0.5 if args.quick else 2.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    begun = time.monotonic()
    points: list[dict[str, Any]] = []
    notes: dict[str, list[str]] = {}
    offline_results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sits-peers-") as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "zoo")
        try:
            if "online" in parts:
                inputs = {model: make_inputs(model, zoo[model]) for model in args.models}
                for round_index in range(args.rounds):
                    online_round(args, round_index, args.systems, home, zoo, inputs, points, notes)
            if "offline" in parts:
                offline_results = offline(args, home, zoo)
        finally:
            for path in SHORT_TEMPS:
                shutil.rmtree(path, ignore_errors=True)
    rows = summarize(points)
    print(f"\nConfiguration: {os.cpu_count()} CPUs, onnxruntime {ort.__version__}; every system: one replica per"
          f" model, ONNX Runtime with SITS's session options ({ORT_THREADS} intra-op threads, ORT_ENABLE_ALL,"
          f" 100 us spin); dynamic batching {BATCH} rows / {WAIT_SECONDS * 1000:g} ms but plain `sits` (its"
          f" defaults); {args.seconds:g} s per point after {args.warm:g} s warm-up, {args.rounds} round(s);"
          " clients on the same cores.")
    for lines in notes.values():
        for line in lines:
            print(f"- {line}")
    if "litserve" in args.systems and "binary" in args.formats and "online" in parts:
        print("- litserve: binary payloads not run (LitServe 0.2.19 always parses the body as JSON or a form)")
    if rows:
        print_online(rows, args.rounds)
    if offline_results:
        print_offline(offline_results, args.rounds, [s for s in args.systems if s.startswith("sits")])
    print(f"\n(total wall time {time.monotonic() - begun:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "chart")},
                                         "notes": notes, "points": points, "online": rows,
                                         "offline": offline_results}, indent=1, default=str))
    if args.chart and rows:
        chart(rows, args.chart)
        print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()

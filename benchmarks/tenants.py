"""Two tenants on one worker: the queue's own order (FIFO) against fair share, measured side by side.

Two parts (`--part`): `jobs` floods with job chunks, `online` with online requests.

jobs: one stack per mode: 1 CPU worker with 1 stream slot (1 ONNX Runtime thread), the zoo transformer
(about 1 ms a row). Tenants S1 (guaranteed 70 %, limit 1.2, preemption target 5 ms) and S2 (30 %,
limit 3.0, 200 ms). Phases:
  shared   both flood the model with a job of short chunks (`--chunk` rows, mini-batches of
           `--mini-batch`): each tenant's share of the device time billed over `--window` seconds
  alone    S1's job is cancelled: S2's share of the wall time over `--alone` seconds (borrowing)
  return   S1 comes back with `--returns` one-row online requests, one at a time, while S2's job runs:
           the P50/P99/max of their first-batch wait (their run's start minus their arrival at the
           API), and the first one's
`fifo` is the same stack with `fair_share.enabled: false`: the queue's order only (S2's job was
submitted second, so under FIFO S1's chunks go first while it floods).

online: one stack per mode, the same worker and tenants, the zoo convnet. Each tenant floods it through
v2 infer (`POST /v2/models/convnet/infer`, one 3x32x32 image a call, JSON) with `--clients` closed-loop
clients (threads, each calling again once answered) for `--seconds`: the device-seconds billed to each,
the calls each got answered and their P50/P99 latency at the client. Then S1 alone, with the same clients,
for as long. `fifo` is fair share off: merged batches take every waiting request, whoever's.
`--run-latency` adds a fixed time to every run (fault injection): the flat latency curve of a GPU.

    python benchmarks/tenants.py --quick                 # about 1.5 minutes
    python benchmarks/tenants.py                         # about 3 minutes
    python benchmarks/tenants.py --part online           # about 2 minutes
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from broker.online.requests import encode_array  # noqa: E402
from broker.tenants.apikeys import create_api_key  # noqa: E402
from sits_api.cli.client import ApiClient  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.device.runtime import session_options  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

TOKENS = 128
TENANTS = {"s1": {"guaranteed_share": 0.7, "limit": 1.2, "preemption_target": "5ms"},
           "s2": {"guaranteed_share": 0.3, "limit": 3.0, "preemption_target": "200ms"}}


def billed(stack: Stack) -> dict[str, float]:
    raw = stack.store.client.hgetall(stack.store.keys.counters)
    return {field.split(":", 1)[1]: int(value) / 1e6 for field, value in raw.items()
            if field.startswith("tenant_device_us:")}


def billed_over(stack: Stack, seconds: float) -> dict[str, float]:
    time.sleep(0.2)
    before = billed(stack)
    time.sleep(seconds)
    after = billed(stack)
    return {tenant: after.get(tenant, 0.0) - before.get(tenant, 0.0) for tenant in ("s1", "s2")}


def tenant_input(home: Path, tenant: str) -> Path:
    """The tokens file in `tenant`'s folder (`home/tenant`, where its keys read by default): a hard link."""
    linked = home / tenant / "tokens.npy"
    linked.parent.mkdir(exist_ok=True)
    if not linked.exists():
        os.link(home / "tokens.npy", linked)
    return linked


def rows_for(seconds: float) -> int:
    """Rows the transformer runs in `seconds` on one ONNX Runtime thread here (timed on 512, in batches
    of 32), with a margin: a job that ends before the phases do would measure nothing."""
    with tempfile.TemporaryDirectory(prefix="sits-tenants-") as tmp:
        session = ort.InferenceSession(str(build_zoo(Path(tmp))["transformer"]), session_options(1),
                                       providers=["CPUExecutionProvider"])
        ids = np.random.default_rng(1).integers(1, 1000, size=(32, TOKENS)).astype(np.int64)
        feed = {node.name: ids if node.name == "input_ids" else np.ones_like(ids) for node in session.get_inputs()}
        session.run(None, feed)
        started = time.perf_counter()
        for _ in range(16):
            session.run(None, feed)
        rate = 512 / (time.perf_counter() - started)
    return int(rate * seconds * 1.3)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One stack in `mode` (fifo or fair), the three phases; the figures."""
    with tempfile.TemporaryDirectory(prefix="sits-tenants-") as tmp:
        home = Path(tmp)
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": 1, "intra_op_threads": 1}, api={"port": 0},
            tenants={**TENANTS, "s1": TENANTS["s1"] | {"preemption_target": args.s1_target}},
            fair_share={"enabled": mode == "fair", "usage_half_life": "10s"})
        np.save(home / "tokens.npy",
                np.random.default_rng(5).integers(1, 1000, size=(args.rows, TOKENS)).astype(np.int64))
        with Stack(settings, worker_count=1, api_port=0) as stack:
            stack.client().post("/v1/models", {"name": "transformer",
                                               "path": str(build_zoo(home / "models")["transformer"])})
            clients = {name: ApiClient(stack.api_url, create_api_key(stack.store, f"{name}-key", tenant=name))
                       for name in TENANTS}
            jobs = {name: clients[name].post("/v1/jobs", {
                "model": "transformer", "input_batch": str(tenant_input(home, name)),
                "output_dir": str(home / name / "out"),
                "chunk_size": args.chunk, "batch_size": args.mini_batch}) for name in TENANTS}
            time.sleep(3.0)
            shared = billed_over(stack, args.window)
            clients["s1"].delete(f"/v1/jobs/{jobs['s1']['id']}")
            time.sleep(1.0)
            alone = billed_over(stack, args.alone)
            ids = np.random.default_rng(9).integers(1, 1000, size=(1, TOKENS)).astype(np.int64)
            waits: list[float] = []
            returns_end = time.monotonic() + 120  # (a starved tenant's requests may each wait long)
            for _ in range(args.returns):
                answer = clients["s1"].post("/v1/requests?wait=true", {
                    "model": "transformer", "inputs": {"input_ids": {"b64": encode_array(ids)}}})
                while answer.get("started_at") is None:  # (not done within online.max_wait: it waits on)
                    time.sleep(0.5)
                    answer = clients["s1"].get(f"/v1/requests/{answer['id']}")
                waits.append((answer["started_at"] - answer["created_at"]) * 1000)
                if time.monotonic() > returns_end:
                    break
                time.sleep(0.05)
            clients["s2"].delete(f"/v1/jobs/{jobs['s2']['id']}")
    total = shared["s1"] + shared["s2"]
    return {"mode": mode, "s1_share": shared["s1"] / total, "s2_share": shared["s2"] / total,
            "s2_alone": alone["s2"] / args.alone, "wait_p50": float(np.percentile(waits, 50)),
            "wait_p99": float(np.percentile(waits, 99)), "waits": waits}


def flood(stack: Stack, keys: dict[str, str], clients: int, seconds: float) -> dict[str, list[float]]:
    """`clients` closed-loop clients per tenant of `keys` calling v2 infer on the convnet for `seconds` (each
    bounded by a count too): the latencies (ms) of each tenant's calls answered within the time."""
    url = urlsplit(stack.api_url)
    pixels = np.random.default_rng(3).standard_normal(3 * 32 * 32).round(3)
    body = json.dumps({"inputs": [{"name": "pixels", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                   "data": pixels.tolist()}]}).encode()
    latencies: dict[str, list[float]] = {tenant: [] for tenant in keys}
    failed: list[int] = []
    ends = time.monotonic() + seconds

    def client(tenant: str) -> None:
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        headers = {"Authorization": f"Bearer {keys[tenant]}", "Content-Type": "application/json"}
        for _ in range(200_000):
            if time.monotonic() >= ends:
                break
            started = time.perf_counter()
            connection.request("POST", "/v2/models/convnet/infer", body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                failed.append(response.status)
            elif time.monotonic() < ends:
                latencies[tenant].append((time.perf_counter() - started) * 1000)
        connection.close()

    threads = [threading.Thread(target=client, args=(tenant,), daemon=True) for tenant in keys for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    if failed:
        print(f"{len(failed)} calls failed: {sorted(set(failed))}", file=sys.stderr)
    return latencies


def flood_phase(stack: Stack, keys: dict[str, str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One flood of `args.seconds`: per tenant, its device-seconds billed, calls answered and P50/P99 (ms)."""
    before = billed(stack)
    latencies = flood(stack, keys, args.clients, args.seconds)
    time.sleep(0.2)  # (bills are written at most 50 ms late)
    after = billed(stack)
    return {tenant: {"billed": after.get(tenant, 0.0) - before.get(tenant, 0.0), "served": len(values),
                     "p50": float(np.percentile(values, 50)) if values else float("nan"),
                     "p99": float(np.percentile(values, 99)) if values else float("nan")}
            for tenant, values in latencies.items()}


def run_online(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One stack in `mode` (fifo or fair): both tenants flood, then S1 alone; the figures."""
    with tempfile.TemporaryDirectory(prefix="sits-tenants-") as tmp:
        home = Path(tmp)
        faults = {"faults": {"enabled": True, "run_latency": args.run_latency}} if args.run_latency else {}
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": 1, "intra_op_threads": 1}, api={"port": 0}, tenants=TENANTS,
            fair_share={"enabled": mode == "fair", "usage_half_life": "10s"}, **faults)
        with Stack(settings, worker_count=1, api_port=0) as stack:
            stack.client().post("/v1/models", {"name": "convnet", "path": str(build_zoo(home / "models")["convnet"])})
            keys = {name: create_api_key(stack.store, f"{name}-key", tenant=name) for name in TENANTS}
            flood(stack, keys, args.clients, 2.0)  # (sessions built, usage found its level)
            shared = flood_phase(stack, keys, args)
            alone = flood_phase(stack, {"s1": keys["s1"]}, args)
    return {"mode": mode, "shared": shared, "alone": alone["s1"]}


def print_online(rows: list[dict[str, Any]]) -> None:
    print("| mode | S1 billed | S2 billed | S1 served | S2 served | S1 P50 / P99 | S2 P50 / P99 | S1 alone served "
          "| S1 alone P50 / P99 | S1 shared / alone |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        s1, s2, alone = row["shared"]["s1"], row["shared"]["s2"], row["alone"]
        total = s1["billed"] + s2["billed"]
        print(f"| {row['mode']} | {s1['billed'] / total:.1%} | {s2['billed'] / total:.1%} | {s1['served']:,} | "
              f"{s2['served']:,} | {s1['p50']:.0f} / {s1['p99']:.0f} ms | {s2['p50']:.0f} / {s2['p99']:.0f} ms | "
              f"{alone['served']:,} | {alone['p50']:.0f} / {alone['p99']:.0f} ms | "
              f"{s1['served'] / alone['served']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("jobs", "online"), default="jobs",
                        help="flood with job chunks or with online requests")
    parser.add_argument("--quick", action="store_true", help="shorter phases")
    parser.add_argument("--rows", type=int, default=0,
                        help="rows of each tenant's job (default: enough for the phases at this machine's speed)")
    parser.add_argument("--chunk", type=int, default=96)
    parser.add_argument("--mini-batch", type=int, default=4)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--alone", type=float, default=10.0)
    parser.add_argument("--returns", type=int, default=200)
    parser.add_argument("--modes", default="fifo,fair", help="which of fifo and fair to run, in order")
    parser.add_argument("--s1-target", default="5ms", help="S1's preemption target (a running chunk looks for "
                                                          "its requests every half of it)")
    parser.add_argument("--waits", action="store_true", help="also print every return wait, in order")
    parser.add_argument("--clients", type=int, default=8, help="online: closed-loop clients per tenant")
    parser.add_argument("--seconds", type=float, default=20.0, help="online: length of each flood")
    parser.add_argument("--run-latency", default="", help="online: time added to every run (e.g. 20ms)")
    args = parser.parse_args()
    if args.part == "online":
        print_online([run_online(mode, args) for mode in args.modes.split(",")])
        return
    if args.quick:
        args.window, args.alone, args.returns = 15.0, 5.0, 60
    if not args.rows:
        args.rows = rows_for(args.window + args.alone + args.returns * 0.06 + 10)
    print("| mode | S1 share | S2 share | S2 alone (of the wall) | S1 return wait P50 | P99 | max | first |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in args.modes.split(","):
        row = run_mode(mode, args)
        if args.waits:
            print(mode, "waits (ms):", " ".join(f"{wait:.1f}" for wait in row["waits"]), file=sys.stderr)
        print(f"| {row['mode']} | {row['s1_share']:.1%} | {row['s2_share']:.1%} | {row['s2_alone']:.1%} | "
              f"{row['wait_p50']:.1f} ms | {row['wait_p99']:.1f} ms | {max(row['waits']):,.1f} ms | "
              f"{row['waits'][0]:,.1f} ms |", flush=True)


if __name__ == "__main__":
    main()

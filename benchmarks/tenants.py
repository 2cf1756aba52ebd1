"""Two tenants on one worker: the queue's own order (FIFO) against fair share, measured side by side.

One stack per mode: 1 CPU worker with 1 stream slot (1 ONNX Runtime thread), the zoo transformer
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

    python benchmarks/tenants.py --quick   # about 1.5 minutes
    python benchmarks/tenants.py           # about 3 minutes
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = parser.parse_args()
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

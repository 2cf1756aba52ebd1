"""`sitsctl model tune` on the zoo's MLP and CNN, and a load test over HTTP at each chosen point.

One stack (Redis, the API, one CPU worker of `--streams` stream slots with one ONNX Runtime thread each, the beat
and a releaser). Each model is registered with `profile_mode: full` (the default space follows its profile),
then tuned with `--method` under `--p99` and applied. Then `--clients` HTTP clients (closed loop, `wait: true`,
one row each, the sweep's own HTTP client, from this process) run at the chosen point's concurrency for
`--seconds`, against the applied batching: requests a second and P50/P99 as the clients timed them, which is
what the bound promises. The pick keeps the default headroom (its P99 at most 80 % of the bound).

    python benchmarks/model_tune.py                    # quick sweep of both models, about 5 minutes
    python benchmarks/model_tune.py --method brute     # every setting (longer)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.client import ApiClient  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_api.tuning.clients import HttpSender  # noqa: E402
from sits_api.tuning.load import closed_loop  # noqa: E402
from sits_worker.model.samples import sample_feed  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402


def tune(client: ApiClient, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Tune `name` and wait for its record."""
    started = client.post(f"/v1/models/{name}/tune", {"p99_ms": args.p99, "method": args.method, "apply": True,
                                                      "refresh": True, "cell_seconds": args.cell_seconds})
    deadline = time.monotonic() + started["planned_seconds"] * 1.5 + 60
    while time.monotonic() < deadline:
        found = [t for t in client.get(started["poll"])["tunings"] if t["ask_id"] == started["ask_id"]]
        if found and all(t["status"] in ("done", "failed") for t in found):
            return found[0]
        time.sleep(1)
    raise SystemExit(f"tuning {name} did not end in time")


def http_load(client: ApiClient, name: str, signature: dict[str, Any], clients: int, seconds: float) -> dict[str, Any]:
    """Closed-loop HTTP clients for `seconds`, the sweep's own client (`HttpSender`) from this process: req/s,
    P50, P99 (ms), failures."""
    sender = HttpSender(client.url, client.key, name, [sample_feed(signature, 1, seed=i) for i in range(8)])
    try:
        seen = closed_loop(sender.send, concurrency=clients, settle=1.0, seconds=seconds)
    finally:
        sender.close()
    return {"clients": clients, "req_per_s": round(seen.throughput, 1), "p50_ms": round(seen.percentile_ms(50), 1),
            "p99_ms": round(seen.percentile_ms(99), 1), "failures": seen.refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,convnet")
    parser.add_argument("--p99", type=float, default=120.0, help="the P99 bound, ms")
    parser.add_argument("--method", choices=["quick", "brute"], default="quick")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--cell-seconds", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=15.0, help="the HTTP load test's length")
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    args = parser.parse_args()
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "models")
        settings = Settings().with_overrides(
            paths={"home": home / "home", "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            resources={"max_concurrent_streams": args.streams, "intra_op_threads": 1})
        with Stack(settings, worker_count=1, api_port=0, beat=True) as stack:
            client = stack.client()
            for name in args.models.split(","):
                record = client.post("/v1/models", {"name": name, "path": str(zoo[name]), "profile_mode": "full"})
                deadline = time.monotonic() + 300
                while record["profile_status"] == "pending" and time.monotonic() < deadline:
                    time.sleep(0.5)
                    record = client.get(f"/v1/models/{name}")
                tuning = tune(client, name, args)
                chosen = tuning["chosen"]
                load = http_load(client, name, record["signature"], chosen["concurrency"], args.seconds) \
                    if chosen else None
                found[name] = {"tuning": tuning, "http_load": load,
                               "batching": client.get(f"/v1/models/{name}")["batching"]}
                print(f"\n{name}: {tuning['method']} sweep, {len(tuning['points'])} points, "
                      f"{tuning['settings_total']} settings in the space, P99 bound {args.p99:g} ms")
                print(f"  {'batch':>5} {'delay ms':>8} {'streams':>7} {'clients':>7} {'req/s':>8} {'P50 ms':>7} "
                      f"{'P99 ms':>7}")
                for point in tuning["front"]:
                    s = point["setting"]
                    mark = " <- chosen" if point == chosen else ""
                    print(f"  {s['max_batch_size']:>5} {s['max_queue_delay_ms']:>8g} {s['streams']:>7} "
                          f"{point['concurrency']:>7} {point['throughput']:>8.1f} {point['p50_ms']:>7.1f} "
                          f"{point['p99_ms']:>7.1f}{mark}")
                if tuning["verified"]:
                    v = tuning["verified"]
                    print(f"  verified in the sweep: {v['throughput']:.1f} req/s, P99 {v['p99_ms']:.1f} ms")
                if load:
                    print(f"  HTTP load test at the pick ({load['clients']} clients, {args.seconds:g} s): "
                          f"{load['req_per_s']} req/s, P50 {load['p50_ms']} ms, P99 {load['p99_ms']} ms, "
                          f"{load['failures']} failures; meets the bound: {(load['p99_ms'] or 1e9) <= args.p99}")
    if args.json_path:
        args.json_path.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()

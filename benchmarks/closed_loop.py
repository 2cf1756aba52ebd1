"""Closed-loop batching against fixed settings: quiet, then a surge, then quiet again, side by side.

For each arm one stack runs (Redis, the API, one CPU worker of `--streams` stream slots with one ONNX Runtime
thread each, the beat and a releaser) with the zoo's `--model` registered with a measured profile. The arms
differ only in the model's batching:
  controller   closed_loop: true toward `--target`, starting from the smallest ceiling and no delay
               (`tuning.controller` every 1 s, patience 2, cooldown 2 s)
  small        the controller's start, fixed: `--small` rows, no delay
  large        `--large` rows and a `--large-delay` wait for company, fixed
  large-nodelay `--large` rows, no delay, fixed
Open-loop load over HTTP (`POST /v1/requests?wait=true`, one row each): arrivals at random (Poisson) at
`--quiet` req/s for `--phase` seconds, at `--surge` req/s for twice that, at `--quiet` again. Each arrival is
sent by one of `--senders` threads; its latency counts from when it was due, so a request that waited for a
free sender counts that wait, as an open-loop client's would. Reported per arm and phase: requests due,
answered a second, P50 and P99, and the share over the target; for the controller arm, its moves.

    python benchmarks/closed_loop.py                  # four arms, about 6 minutes
    python benchmarks/closed_loop.py --arms controller,large-nodelay
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.open_loop_http import send_at  # noqa: E402
from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.samples import sample_feed  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402


def arm_batching(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """The model's `online.models` entry in one arm."""
    if arm == "controller":
        return {"closed_loop": True, "target_p99": args.target / 1000, "max_batch_size": args.small,
                "max_queue_delay": 0}
    if arm == "small":
        return {"max_batch_size": args.small, "max_queue_delay": 0}
    if arm == "large":
        return {"max_batch_size": args.large, "max_queue_delay": args.large_delay / 1000}
    return {"max_batch_size": args.large, "max_queue_delay": 0}


def open_loop(url: str, key: str, body_rows: list[bytes], phases: list[tuple[str, float, float]],
              senders: int, seed: int) -> dict[str, list[tuple[float, float | None]]]:
    """Send Poisson arrivals phase by phase; per phase, (due time, latency or None when it failed)."""
    rng = np.random.default_rng(seed)
    arrivals: list[tuple[float, bytes]] = []
    bounds: list[tuple[str, float]] = []
    at = time.monotonic() + 0.5
    for phase, rate, seconds in phases:
        ends = at + seconds
        while (at := at + rng.exponential(1 / rate)) < ends:
            arrivals.append((at, body_rows[len(arrivals) % len(body_rows)]))
        at = ends
        bounds.append((phase, ends))
    found: dict[str, list[tuple[float, float | None]]] = {name: [] for name, _, _ in phases}
    for due, latency in send_at(url, key, arrivals, senders):
        found[next(name for name, ends in bounds if due < ends)].append((due, latency))
    return found


def summary(samples: list[tuple[float, float | None]], seconds: float, target_ms: float) -> dict[str, Any]:
    """Requests due, answered a second, P50/P99 (ms) and the share over the target (failures count over)."""
    latencies = [lat * 1000 for _, lat in samples if lat is not None]
    failed = sum(1 for _, lat in samples if lat is None)
    over = sum(1 for lat in latencies if lat > target_ms) + failed
    return {"due": len(samples), "answered_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1) if latencies else None,
            "p99_ms": round(float(np.percentile(latencies, 99)), 1) if latencies else None,
            "over_target": round(over / len(samples), 4) if samples else None, "failed": failed}


def run_arm(arm: str, args: argparse.Namespace, zoo: dict[str, Path], home: Path) -> dict[str, Any]:
    settings = Settings().with_overrides(
        paths={"home": home / arm, "model_roots": (zoo[args.model].parent,), "input_roots": (home,),
               "output_roots": (home,)},
        resources={"max_concurrent_streams": args.streams, "intra_op_threads": 1},
        online={"models": {args.model: arm_batching(arm, args)}},
        tuning={"controller": {"every": "1s", "patience": 2, "cooldown": "2s", "min_answered": 10}})
    with Stack(settings, worker_count=1, api_port=0, beat=True) as stack:
        client = stack.client()
        record = client.post("/v1/models", {"name": args.model, "path": str(zoo[args.model]), "profile_mode": "full"})
        while record["profile_status"] == "pending":
            time.sleep(0.5)
            record = client.get(f"/v1/models/{args.model}")
        bodies = [json.dumps({"model": args.model, "inputs": {k: v.tolist() for k, v in
                                                                sample_feed(record["signature"], 1, seed=i).items()}})
                  .encode() for i in range(8)]
        for body in bodies:  # (warm the session)
            client.post("/v1/requests?wait=true", json.loads(body))
        phases = [("quiet", args.quiet, args.phase), ("surge", args.surge, 2 * args.phase),
                  ("quiet again", args.quiet, args.phase)]
        steps: list[dict[str, Any]] = []
        done = threading.Event()
        watcher = threading.Thread(target=watch_steps, args=(stack, args.model, steps, done), daemon=True)
        watcher.start()
        found = open_loop(client.url, client.key, bodies, phases, args.senders, args.seed)
        done.set()
        watcher.join()
        changes = client.get(f"/v1/models/{args.model}/tune")["controller_changes"]
    return {"phases": {name: summary(found[name], seconds, args.target) for name, _, seconds in phases},
            "moves": [{"after": c["after"], "reason": c["reason"]} for c in reversed(changes)], "steps": steps}


def watch_steps(stack: Stack, model: str, steps: list[dict[str, Any]], done: threading.Event) -> None:
    """The controller's last step as it stores it, read every 0.5 s (the window it saw and why it held or moved)."""
    store = stack.store
    last_at = None
    while not done.wait(0.5):
        for field, raw in store.client.hgetall(store.keys.controllers).items():
            if field.startswith(f"{model}@"):
                step = json.loads(raw)
                if step["at"] != last_at:
                    last_at = step["at"]
                    steps.append({k: step.get(k) for k in ("at", "answered", "p99", "waiting", "batch_size", "delay",
                                                           "reason")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--arms", default="controller,small,large,large-nodelay")
    parser.add_argument("--target", type=float, default=50.0, help="the P99 target, ms")
    parser.add_argument("--quiet", type=float, default=20.0, help="quiet arrivals a second")
    parser.add_argument("--surge", type=float, default=250.0, help="surge arrivals a second")
    parser.add_argument("--phase", type=float, default=15.0, help="seconds of each quiet phase (the surge: twice)")
    parser.add_argument("--small", type=int, default=1)
    parser.add_argument("--large", type=int, default=64)
    parser.add_argument("--large-delay", type=float, default=5.0, help="the large arm's delay, ms")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--senders", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", action="store_true", help="print each controller step (window and decision)")
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        zoo = build_zoo(Path(tmp) / "models")
        for arm in args.arms.split(","):
            results[arm] = run_arm(arm, args, zoo, Path(tmp))
            print(f"\n{arm}:")
            for phase, figures in results[arm]["phases"].items():
                print(f"  {phase:12s} due {figures['due']:6d}  {figures['answered_per_s']:7.1f} req/s  "
                      f"P50 {figures['p50_ms']} ms  P99 {figures['p99_ms']} ms  over {args.target:g} ms: "
                      f"{100 * (figures['over_target'] or 0):.1f} %  failed {figures['failed']}")
            for move in results[arm]["moves"]:
                print(f"  move: {move['after']} ({move['reason']})")
            if args.steps:
                for step in results[arm]["steps"]:
                    p99 = f"{1000 * step['p99']:.1f} ms" if step["p99"] is not None else "-"
                    print(f"    step: {step['answered']} answered, P99 {p99}, {step['waiting']} waiting -> "
                          f"{step['batch_size']}, {1000 * step['delay']:g} ms ({step['reason']})")
    if args.json_path:
        args.json_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

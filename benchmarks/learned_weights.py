"""Learned CP-Score weights against the defaults: deadline misses on a shifting mix of two models, per seed.

For each seed and arm one stack runs (Redis, the API, one CPU worker of two stream slots with one ONNX Runtime
thread each, the beat and a releaser) with the zoo's MLP and CNN registered with measured profiles (the
latency term of CP-Score reads them). The arms differ only in `tuning.weights`:
  defaults   the learner off: α, β, γ, δ at their defaults the whole run
  learned    the learner on, every `--window` seconds, with the seed
Open-loop load over HTTP (Poisson arrivals, one row each, `wait: true`), a little past what the worker
serves, so that the order of waiting work decides who meets a deadline. The mix shifts halfway:
  first half   70 % CNN requests (deadline `--cnn-deadline`), 30 % MLP (`--mlp-deadline`)
  second half  30 % CNN, 70 % MLP
Priority levels 4 and 8 and tiers free and vip are drawn at random for each request. The load starts
`--warmup` seconds before the counted run (the first half's mix; a stack's first seconds are slow), and the
arms alternate which runs first from seed to seed. Reported per arm and seed: requests due, deadlines
missed (answered late, or failed) overall and in each half, and for the learned arm the weights it ended with.

    python benchmarks/learned_weights.py                          # 2 seeds, about 10 minutes
    python benchmarks/learned_weights.py --seeds 1,2,3 --seconds 240
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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


def bodies(signatures: dict[str, dict[str, Any]], deadlines: dict[str, float], rng: np.random.Generator,
           count: int, share_cnn: float) -> list[tuple[str, bytes]]:
    """`count` request bodies: (model, JSON), the CNN's share `share_cnn`, levels and tiers at random."""
    rows = {name: {k: v.tolist() for k, v in sample_feed(sig, 1, seed=1).items()} for name, sig in signatures.items()}
    made = []
    for _ in range(count):
        model = "convnet" if rng.random() < share_cnn else "mlp"
        made.append((model, json.dumps({"model": model, "inputs": rows[model], "deadline_ms": deadlines[model],
                                        "priority": int(rng.choice([4, 8])),
                                        "user_tier": str(rng.choice(["free", "vip"]))}).encode()))
    return made


def run_load(url: str, key: str, arrivals: list[tuple[float, str, bytes]], senders: int) -> list[tuple[float, bool]]:
    """Send each (due, model, body) at its time; per request (due time, met its deadline)."""
    deadlines = [json.loads(body)["deadline_ms"] / 1000 for _, _, body in arrivals]
    by_due = dict(zip((at for at, _, _ in arrivals), deadlines, strict=True))
    sent = send_at(url, key, [(at, body) for at, _, body in arrivals], senders)
    return [(at, latency is not None and latency <= by_due[at]) for at, latency in sent]


def run_arm(arm: str, seed: int, args: argparse.Namespace, zoo: dict[str, Path], home: Path) -> dict[str, Any]:
    weights = {"every": f"{args.window}s", "seed": seed} if arm == "learned" else {"every": "0s"}
    settings = Settings().with_overrides(
        paths={"home": home / f"{arm}-{seed}", "model_roots": (zoo["mlp"].parent,), "input_roots": (home,),
               "output_roots": (home,)},
        resources={"max_concurrent_streams": 2, "intra_op_threads": 1}, tuning={"weights": weights})
    with Stack(settings, worker_count=1, api_port=0, beat=True) as stack:
        client = stack.client()
        signatures = {}
        for name in ("mlp", "convnet"):
            record = client.post("/v1/models", {"name": name, "path": str(zoo[name]), "profile_mode": "full"})
            while record["profile_status"] == "pending":
                time.sleep(0.5)
                record = client.get(f"/v1/models/{name}")
            signatures[name] = record["signature"]
        rng = np.random.default_rng(seed)
        deadlines = {"mlp": args.mlp_deadline, "convnet": args.cnn_deadline}
        made = [bodies(signatures, deadlines, rng, 400, share) for share in (0.7, 0.3)]  # (before the clock starts)
        begin = time.monotonic() + 1.0
        start = begin + args.warmup  # (the load runs from `begin`; what is due before `start` is not counted)
        arrivals: list[tuple[float, str, bytes]] = []
        at = begin
        while (at := at + rng.exponential(1 / args.rate)) < start:
            arrivals.append((at, *made[0][len(arrivals) % len(made[0])]))
        at = start
        for half in (0, 1):
            ends = start + (half + 1) * args.seconds / 2
            index = 0
            while (at := at + rng.exponential(1 / args.rate)) < ends:
                arrivals.append((at, *made[half][index % len(made[half])]))
                index += 1
            at = ends
        found = run_load(client.url, client.key, arrivals, args.senders)
        learned = client.get("/v1/policy") if arm == "learned" else {}
    middle = start + args.seconds / 2
    found = [(due, met) for due, met in found if due >= start]
    halves = [[met for due, met in found if (due < middle) == first] for first in (True, False)]
    report = {"due": len(found), "missed": sum(1 for _, met in found if not met),
              "missed_first_half": sum(1 for met in halves[0] if not met),
              "missed_second_half": sum(1 for met in halves[1] if not met)}
    if learned:
        report["weights"] = {name: round(learned[name], 3) for name in ("alpha", "beta", "gamma", "delta")}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--seconds", type=float, default=120.0, help="the run's length (the mix shifts halfway)")
    parser.add_argument("--rate", type=float, default=140.0, help="arrivals a second")
    parser.add_argument("--window", type=float, default=2.0, help="the learner's window, seconds")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of load first, not counted")
    parser.add_argument("--mlp-deadline", type=float, default=150.0, help="ms")
    parser.add_argument("--cnn-deadline", type=float, default=600.0, help="ms")
    parser.add_argument("--senders", type=int, default=96)
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        zoo = build_zoo(Path(tmp) / "models")
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in ("defaults", "learned") if seed % 2 else ("learned", "defaults"):  # (neither always first)
                found = run_arm(arm, seed, args, zoo, Path(tmp))
                results[f"{arm}/{seed}"] = found
                print(f"seed {seed} {arm:8s}: {found['due']} due, {found['missed']} deadlines missed "
                      f"({found['missed_first_half']} + {found['missed_second_half']})"
                      + (f", weights {found['weights']}" if "weights" in found else ""), flush=True)
    if args.json_path:
        args.json_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

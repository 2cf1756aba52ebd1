"""Learned CP-Score weights against the defaults: deadline misses on a shifting mix, per seed.

For each seed and arm one stack runs (Redis, the API, one CPU worker of two stream slots with one ONNX Runtime
thread each, the beat and a releaser) with the zoo's MLP and CNN registered with measured profiles (the
latency term of CP-Score reads them). The arms differ only in `tuning.weights`:
  defaults   the learner off: α, β, γ, δ at their defaults the whole run
  learned    the learner on, every `--window` seconds, with the seed
Open-loop load over HTTP (Poisson arrivals, `wait: true`). Two scenarios (`--scenario`):

`mixed`: one row a request, a little past what the worker serves. The mix shifts halfway:
  first half   70 % CNN requests (deadline `--cnn-deadline`), 30 % MLP (`--mlp-deadline`)
  second half  30 % CNN, 70 % MLP
  Priority levels 4 and 8 and tiers free and vip are drawn at random for each request.

`sizes`: CNN requests only, all at priority level 4, in two classes whose tiers and sizes pull against their
deadlines. CP-Score's defaults put a small request well ahead of a large one (α) and a vip one a little
ahead of a free one (β), so here they serve the wrong class first:
  vip    `--vip-rows` images a request (8), deadline `--vip-deadline` (250 ms), `--vip-rate` a second (10)
  free   `--free-rows` images a request (4), deadline `--free-deadline` (3 s): `--free-rate` a second, and in
         bursts of `--burst-seconds` every `--burst-every` seconds a further `--burst-rate` a second, past what
         the worker serves
  The mix shifts halfway: the second half's bursts come at `--burst-rate-late`.

The load starts `--warmup` seconds before the counted run (the first half's mix; a stack's first seconds
are slow), and the arms alternate which runs first from seed to seed. Reported per arm and seed: requests
due, deadlines missed (answered late, or failed) overall and in each half, and for the learned arm the
weights it ended with.

    python benchmarks/learned_weights.py                          # 2 seeds, about 10 minutes
    python benchmarks/learned_weights.py --seeds 1,2,3 --seconds 240
    python benchmarks/learned_weights.py --scenario sizes --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
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


def size_bodies(signature: dict[str, Any], args: argparse.Namespace) -> dict[str, bytes]:
    """The `sizes` scenario's two request bodies, by class (pixels rounded to 1 decimal: smaller JSON)."""
    made = {}
    for klass, rows, tier, deadline in (("vip", args.vip_rows, "vip", args.vip_deadline),
                                        ("free", args.free_rows, "free", args.free_deadline)):
        feed = sample_feed(signature, rows, seed=1)
        inputs = {name: np.round(array.astype(np.float64), 1).tolist() for name, array in feed.items()}
        made[klass] = json.dumps({"model": "convnet", "inputs": inputs, "deadline_ms": deadline, "priority": 4,
                                  "user_tier": tier}).encode()
    return made


def size_arrivals(made: dict[str, bytes], rng: np.random.Generator, args: argparse.Namespace, *, begin: float,
                  start: float) -> list[tuple[float, str, bytes]]:
    """Poisson arrivals of both classes from `begin` to the run's end, and the free class's bursts, one every
    `burst_every` seconds from the counted run's start (none in the warm-up). With a learner window a whole
    number of burst periods long, every window sees as many bursts, wherever it starts."""
    ends, middle = start + args.seconds, start + args.seconds / 2
    arrivals: list[tuple[float, str, bytes]] = []
    at = begin
    while (at := at + rng.exponential(1 / args.vip_rate)) < ends:
        arrivals.append((at, "convnet", made["vip"]))
    bursts = [start + index * args.burst_every for index in range(int(args.seconds / args.burst_every))]
    at = begin
    while (at := at + rng.exponential(1 / args.free_rate)) < ends:
        arrivals.append((at, "convnet", made["free"]))
    for burst in bursts:
        at, stop = burst, min(burst + args.burst_seconds, ends)
        rate = args.burst_rate if burst < middle else args.burst_rate_late
        while (at := at + rng.exponential(1 / rate)) < stop:
            arrivals.append((at, "convnet", made["free"]))
    return sorted(arrivals, key=lambda arrival: arrival[0])


def run_load(url: str, key: str, arrivals: list[tuple[float, str, bytes]],
             senders: int) -> list[tuple[float, float, float | None]]:
    """Send each (due, model, body) at its time; per request (due time, its deadline in ms, seconds from due to
    its answer, None when it failed or was not answered by its deadline)."""
    deadline_of: dict[int, float] = {}  # (read once a body: the bodies are shared, and reading each arrival's
    # would take seconds of a run that is already due)
    for _, _, body in arrivals:
        if id(body) not in deadline_of:
            deadline_of[id(body)] = json.loads(body)["deadline_ms"]
    by_due = {at: deadline_of[id(body)] for at, _, body in arrivals}
    errors: Counter[str] = Counter()
    sent = send_at(url, key, [(at, body) for at, _, body in arrivals], senders, errors)
    if errors:
        print(f"  {sum(errors.values())} of {len(sent)} requests failed (warm-up included): {dict(errors)}",
              flush=True)
    return [(at, by_due[at], latency) for at, latency in sent]


def by_deadline(found: list[tuple[float, float, float | None]]) -> dict[str, dict[str, Any]]:
    """Per deadline (ms): requests due, deadlines missed, answers that failed, and P50/P99 of those answered."""
    report = {}
    for deadline in sorted({deadline for _, deadline, _ in found}):
        latencies = [latency for _, own, latency in found if own == deadline]
        answered = sorted(latency for latency in latencies if latency is not None)
        report[f"{deadline:g}"] = {
            "due": len(latencies), "missed": sum(1 for latency in latencies if latency is None
                                                 or latency > deadline / 1000),
            "failed": len(latencies) - len(answered),
            "p50_ms": round(1000 * answered[len(answered) // 2], 1) if answered else None,
            "p99_ms": round(1000 * answered[int(len(answered) * 0.99)], 1) if answered else None}
    return report


def run_arm(arm: str, seed: int, args: argparse.Namespace, zoo: dict[str, Path], home: Path) -> dict[str, Any]:
    weights = {"every": f"{args.window}s", "seed": seed} if arm == "learned" else {"every": "0s"}
    settings = Settings().with_overrides(
        paths={"home": home / f"{arm}-{seed}", "model_roots": (zoo["mlp"].parent,), "input_roots": (home,),
               "output_roots": (home,)},
        resources={"max_concurrent_streams": args.streams, "intra_op_threads": 1}, tuning={"weights": weights},
        api={"threads": args.api_threads, "max_waits_per_tenant": 0})
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
        if args.scenario == "sizes":
            made_sizes = size_bodies(signatures["convnet"], args)
            begin = time.monotonic() + 1.0
            start = begin + args.warmup
            arrivals = size_arrivals(made_sizes, rng, args, begin=begin, start=start)
        else:
            arrivals, begin, start = mixed_arrivals(signatures, rng, args)
        found = run_load(client.url, client.key, arrivals, args.senders)
        learned = client.get("/v1/policy") if arm == "learned" else {}
    middle = start + args.seconds / 2
    if args.timeline:
        print_timeline(found, begin, args.timeline)
    found = [(due, deadline, latency) for due, deadline, latency in found if due >= start]
    missed = [(due, latency is None or latency > deadline / 1000) for due, deadline, latency in found]
    report = {"due": len(found), "missed": sum(1 for _, miss in missed if miss),
              "missed_first_half": sum(1 for due, miss in missed if miss and due < middle),
              "missed_second_half": sum(1 for due, miss in missed if miss and due >= middle),
              "by_deadline_ms": by_deadline(found),
              "missed_each_10s": [sum(1 for due, miss in missed if miss and start + tenth <= due < start + tenth + 10)
                                  for tenth in range(0, int(args.seconds), 10)]}
    if learned:
        report["weights"] = {name: round(learned[name], 3) for name in ("alpha", "beta", "gamma", "delta")}
    return report


def print_timeline(found: list[tuple[float, float, float | None]], begin: float, every: float) -> None:
    """Per `every` seconds from the load's beginning (warm-up included): requests due, deadlines missed, and
    the P50 and the longest of the latencies answered."""
    ends = max(due for due, _, _ in found)
    at = begin
    while at <= ends:
        window = [(deadline, latency) for due, deadline, latency in found if at <= due < at + every]
        answered = sorted(latency for _, latency in window if latency is not None)
        missed = sum(1 for deadline, latency in window if latency is None or latency > deadline / 1000)
        print(f"    {at - begin:6.1f} s: {len(window):4d} due, {missed:4d} missed, P50 "
              f"{1000 * answered[len(answered) // 2] if answered else 0:7.1f} ms, longest "
              f"{1000 * answered[-1] if answered else 0:7.1f} ms", flush=True)
        at += every


def mixed_arrivals(signatures: dict[str, dict[str, Any]], rng: np.random.Generator,
                   args: argparse.Namespace) -> tuple[list[tuple[float, str, bytes]], float, float]:
    """The `mixed` scenario's arrivals, and when the load begins and the counted run starts."""
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
    return arrivals, begin, start


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
    parser.add_argument("--arms", default="defaults,learned")
    parser.add_argument("--streams", type=int, default=2, help="the worker's stream slots (one ORT thread each)")
    parser.add_argument("--api-threads", type=int, default=16,
                        help="request threads per API process (2): each waiting request holds one, so only these "
                             "many wait in Redis, where their order is decided; the rest wait in the API's backlog")
    parser.add_argument("--timeline", type=float, default=0.0,
                        help="print due, missed and latencies every so many seconds of the load (0: not)")
    parser.add_argument("--scenario", choices=("mixed", "sizes"), default="mixed")
    parser.add_argument("--vip-rows", type=int, default=8, help="sizes: images in a vip request")
    parser.add_argument("--vip-deadline", type=float, default=250.0, help="sizes: ms")
    parser.add_argument("--vip-rate", type=float, default=10.0, help="sizes: vip requests a second")
    parser.add_argument("--free-rows", type=int, default=4, help="sizes: images in a free request")
    parser.add_argument("--free-deadline", type=float, default=3000.0, help="sizes: ms")
    parser.add_argument("--free-rate", type=float, default=20.0, help="sizes: free requests a second between bursts")
    parser.add_argument("--burst-rate", type=float, default=150.0, help="sizes: free requests a second in a burst")
    parser.add_argument("--burst-rate-late", type=float, default=180.0, help="sizes: the same, second half")
    parser.add_argument("--burst-seconds", type=float, default=0.5, help="sizes: a burst's length")
    parser.add_argument("--burst-every", type=float, default=2.0, help="sizes: seconds from one burst to the next")
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        zoo = build_zoo(Path(tmp) / "models")
        for seed in (int(s) for s in args.seeds.split(",")):
            arms = [arm for arm in (("defaults", "learned") if seed % 2 else ("learned", "defaults"))
                    if arm in args.arms.split(",")]  # (neither always first)
            for arm in arms:
                found = run_arm(arm, seed, args, zoo, Path(tmp))
                results[f"{arm}/{seed}"] = found
                print(f"seed {seed} {arm:8s}: {found['due']} due, {found['missed']} deadlines missed "
                      f"({found['missed_first_half']} + {found['missed_second_half']})"
                      + f", each 10 s {found['missed_each_10s']}"
                      + "".join(f"\n    deadline {deadline} ms: {figures}"
                                for deadline, figures in found["by_deadline_ms"].items())
                      + (f", weights {found['weights']}" if "weights" in found else ""), flush=True)
    if args.json_path:
        args.json_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

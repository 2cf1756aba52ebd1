"""The beat's re-scoring measured: a stale latency estimate corrected while work waits, and a deadline kept.

One stack (Redis, the API, one CPU worker of one stream slot, the beat and a releaser) serves two models,
both registered with the default `profile_mode: static`:

- `looped`: 500 steps of a 1024 x 1024 MatMul inside an ONNX `Loop`. Static analysis does not see into a loop's
  body, so its FLOPs estimate is 0: 0.01 ms a request, the full latency term of CP-Score. A run really takes
  about 45 ms. `online.models.looped.max_batch_size: 1`, so its backlog drains one request a run.
- `mlp` (the zoo's): about 0.2 ms a request, the full latency term by FLOPs and by its profile alike.

`--backlog` looped requests arrive first (about 30 s of work), then `--urgent` mlp requests with a deadline
`--deadline` seconds away. At level 0 with equal latency points the mlp requests wait behind the whole backlog.
Within `FLUSH_SECONDS` (10 s) of the first looped runs the worker writes looped's observed profile (45 ms:
about 0.9 latency points instead of 4). With `beat.rescore_every` 5 s the beat's next pass re-estimates the
waiting looped requests and their scores move back by about 3 points, the mlp requests go ahead and keep their
deadline. With `beat.rescore_every 0` nothing re-scores them until they leave, and the mlp requests wait.

Reported per phase: when the observed profile landed and when the first re-estimate happened (seconds from the
urgent requests' arrival), the urgent requests' deadlines met and missed, their wait (median, max), how many
looped requests answered after the first urgent one, or never (the ones it passed), and the items the beat
moved (`sits_rescore_moved_items_total`). Each phase is bounded: it ends when every urgent request is answered,
or `--deadline` + 30 s after they arrived.

    python benchmarks/beat_rescore.py                 # both phases, about 3 minutes
    python benchmarks/beat_rescore.py --phases beat   # one phase
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config.settings import Settings  # noqa: E402
from broker.models import registry  # noqa: E402
from broker.online.requests import encode_array  # noqa: E402
from sits_api.cli.client import ApiClient  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

WIDTH, STEPS = 1024, 500


def looped_model(path: Path) -> Path:
    """x [batch, 1024] -> y: STEPS x (MatMul by a fixed 1024 x 1024 matrix, then Tanh), inside a Loop."""
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    row = ["batch", WIDTH]
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "step",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, row)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, row)],
        [numpy_helper.from_array(weights, "w")])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["steps", "go", "x"], ["y"], body=body)], "looped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, row)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, row)],
        [numpy_helper.from_array(np.array(STEPS, np.int64), "steps"), numpy_helper.from_array(np.array(True), "go")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def submit_all(client: ApiClient, bodies: list[dict[str, Any]], threads: int = 4) -> list[str]:
    """Submit `bodies` as v1 requests (not waiting for answers), `threads` at once; their ids in order."""
    ids: list[str] = [""] * len(bodies)

    def submit(start: int) -> None:
        own = ApiClient(client.url, client.key)
        for index in range(start, len(bodies), threads):
            ids[index] = own.post("/v1/requests", bodies[index])["id"]

    workers = [threading.Thread(target=submit, args=(start,)) for start in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return ids


def run_phase(name: str, rescore_every: str, args: argparse.Namespace, zoo: dict[str, Path], looped: Path,
              home: Path) -> dict[str, Any]:
    settings = Settings().with_overrides(
        paths={"home": home, "model_roots": (home, looped.parent, zoo["mlp"].parent), "input_roots": (home,),
               "output_roots": (home,)},
        resources={"max_concurrent_streams": 1, "intra_op_threads": 1},
        online={"models": {"looped": {"max_batch_size": 1}}},
        beat={"rescore_every": rescore_every})
    with Stack(settings, worker_count=1, api_port=0, beat=True) as stack:
        client, store, keys = stack.client(), stack.store, stack.store.keys
        client.post("/v1/models", {"name": "looped", "path": str(looped)})
        client.post("/v1/models", {"name": "mlp", "path": str(zoo["mlp"])})
        looped_ref = registry.get_model(store, "looped").ref
        mlp_ref = registry.get_model(store, "mlp").ref
        backlog = [{"model": "looped", "inputs": {"x": {"b64": encode_array(np.full((1, WIDTH), i % 7, np.float32))}}}
                   for i in range(args.backlog)]
        looped_ids = submit_all(client, backlog)
        time.sleep(1.0)
        urgent_at = time.time()
        features = np.zeros((1, 64), np.float32)
        urgent = [{"model": "mlp", "inputs": {"features": {"b64": encode_array(features)}},
                   "deadline_ms": args.deadline * 1000} for _ in range(args.urgent)]
        urgent_ids = submit_all(client, urgent, threads=2)
        profile_at = re_estimated_at = None
        ends = urgent_at + args.deadline + 30
        while time.time() < ends:
            now = time.time()
            if profile_at is None and registry.get_model(store, looped_ref).observed_profile:
                profile_at = now - urgent_at
            if re_estimated_at is None and store.client.hget(keys.counters, f"rescore_moved_latency:{looped_ref}"):
                re_estimated_at = now - urgent_at
            statuses = [store.client.hget(keys.request(request_id), "status") for request_id in urgent_ids]
            if all(status not in ("queued", "running", None) for status in statuses):
                break
            time.sleep(0.1)
        urgent_done = [store.client.hmget(keys.request(request_id), "created_at", "finished_at")
                       for request_id in urgent_ids]
        waits = [float(finished) - float(created) for created, finished in urgent_done if finished]
        first_answer = min((float(finished) for _, finished in urgent_done if finished), default=None)
        looped_finished = [store.client.hget(keys.request(request_id), "finished_at") for request_id in looped_ids]
        passed = sum(1 for finished in looped_finished  # (still waiting when it was answered, or answered after)
                     if first_answer is not None and (not finished or float(finished) > first_answer))
        counters = store.client.hgetall(keys.counters)
        return {
            "phase": name, "rescore_every": rescore_every,
            "profile_landed_s": profile_at, "first_re_estimate_s": re_estimated_at,
            "deadlines_met": int(counters.get(f"request_deadline_met:{mlp_ref}", 0)),
            "deadlines_missed": int(counters.get(f"request_deadline_missed:{mlp_ref}", 0)),
            "not_answered": len(urgent_ids) - len(waits),
            "wait_p50_s": statistics.median(waits) if waits else None, "wait_max_s": max(waits, default=None),
            "looped_passed": passed,
            "moved_latency": int(counters.get(f"rescore_moved_latency:{looped_ref}", 0)),
            "looped_left_waiting": store.client.zcard(keys.ready(looped_ref)),
        }


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=700, help="looped requests queued first")
    parser.add_argument("--urgent", type=int, default=20, help="mlp requests with a deadline, queued after")
    parser.add_argument("--deadline", type=float, default=25.0, help="seconds from their arrival")
    parser.add_argument("--phases", default="beat,off", help="beat (rescore_every 5s), off (rescore_every 0)")
    args = parser.parse_args()
    phases = {"beat": "5s", "off": "0"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        zoo = build_zoo(root / "zoo")
        looped = looped_model(root / "looped.onnx")
        for name in args.phases.split(","):
            home = root / name
            home.mkdir()
            rows.append(run_phase(name, phases[name], args, zoo, looped, home))
            print(rows[-1], flush=True)
    columns = list(rows[0])
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(fmt(row[column]) for column in columns) + " |")


if __name__ == "__main__":
    main()

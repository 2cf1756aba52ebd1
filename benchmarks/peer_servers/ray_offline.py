"""Ray Data 2.60 batch inference over a `.npy` file: `read_numpy` -> `map_batches` (one actor with a
SITS-configured ONNX Runtime session) -> `write_numpy`, on a local Ray started here (2 CPUs, no
dashboard, its own temp folder). Prints one JSON line: the rows/s of each timed run.

    python ray_offline.py --model /m/mlp.onnx --input mlp.npy --batch 512 --out /tmp/out --temp-dir /tmp/rayXYZ

A warm-up run over the first rows comes first (Ray's workers started, the imports cached); each timed
run then goes from the start of execution (the lazy plan starts with `write_numpy`) to the last output
file written, so it includes reading the input and writing the outputs, as a SITS job's time does
(first lease to finalized manifest). Every execution starts its own actor pool (a new worker process
that builds the session), so each run pays that start-up again: after the timed runs, a run over the
warm-up's rows (one batch, at most a 16th of the input) measures it, and `rows_per_s_after_start`
takes it out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ray  # noqa: E402
from _common import ROOT, exit_on_sigterm  # noqa: E402


class Predictor:
    """The map_batches UDF: one session per actor, the column `data` in, `logits` out."""

    def __init__(self, path: str) -> None:
        from _common import Model  # in the actor's process

        self.model = Model(path)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": self.model.run(np.ascontiguousarray(batch["data"], dtype=np.float32))}


def run(model: str, source: str, batch: int, out: Path) -> float:
    """Seconds for one pass over `source`, outputs written to `out`."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    dataset = ray.data.read_numpy(source)
    dataset = dataset.map_batches(Predictor, fn_constructor_args=(model,), batch_size=batch,
                                  compute=ray.data.ActorPoolStrategy(size=1), batch_format="numpy", num_cpus=1)
    dataset.write_numpy(str(out), column="logits")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = int(np.load(args.input, mmap_mode="r").shape[0])
    warm = args.out.parent / f"{args.out.name}-warm.npy"
    np.save(warm, np.load(args.input, mmap_mode="r")[: max(1, min(args.batch, rows // 16))])  # one batch at most
    path = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=args.temp_dir, log_to_driver=False,
             object_store_memory=2 * 1024**3, runtime_env={"env_vars": {"PYTHONPATH": path}})
    exit_on_sigterm()
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        warm_seconds = run(args.model, str(warm), args.batch, args.out)
        seconds = [run(args.model, args.input, args.batch, args.out) for _ in range(args.repeats)]
        small = run(args.model, str(warm), args.batch, args.out.parent / f"{args.out.name}-small")
        written = sum(int(np.load(part, mmap_mode="r").shape[0]) for part in args.out.glob("*.npy"))
        if written != rows:
            raise SystemExit(f"Ray Data wrote {written} rows of {rows}")
        print(json.dumps({"rows": rows, "batch": args.batch, "seconds": seconds, "warm_seconds": warm_seconds,
                          "small_seconds": small, "rows_per_s": [rows / s for s in seconds],
                          "rows_per_s_after_start": [rows / max(s - small, 1e-9) for s in seconds]}), flush=True)
    finally:
        ray.shutdown()
        warm.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

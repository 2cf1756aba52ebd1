"""`sitsctl demo`: the main job, end to end, on the embedded stack.

Starts Redis, the API and workers; builds and registers the zoo;
runs an offline job on the convnet with a live progress bar and a summary;
checks a second job on the MLP against an independent numpy forward pass
of the same weights; stops everything it started and exits 0 on success.
Run again in the same SITS_HOME, it first clears its earlier results; any
failure ends with its "demo FAILED" line and exit code 1.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape

from broker.config.loading import load_settings
from broker.errors import SitsError
from broker.state.embedded import masked_url
from sits_api.cli.client import ApiClient
from sits_api.cli.progress import wait_for_job
from sits_api.cli.stack import Stack
from sits_worker.model.inputs import file_checksum
from sits_worker.model.zoo import build_zoo, mlp_reference

MIN_ROWS = 10_000


def run_demo(console: Console, *, rows: int, worker_count: int) -> int:
    """Run the demo; returns the process exit code."""
    started = time.monotonic()
    try:
        ok = _run(console, max(rows, MIN_ROWS), worker_count, started)
    except (SitsError, OSError) as err:  # the API refused something, the stack did not start, a file ...
        console.print(f"[red]error:[/red] {escape(err.message if isinstance(err, SitsError) else str(err))}",
                      soft_wrap=True)
        ok = False
    console.print(f"demo {'[green]passed[/green]' if ok else '[red]FAILED[/red]'} "
                  f"in {time.monotonic() - started:.1f}s")
    return 0 if ok else 1


def _run(console: Console, rows: int, worker_count: int, started: float) -> bool:
    settings = load_settings()
    demo_dir = settings.paths.home / "demo"
    roots = (demo_dir,)
    settings = settings.with_overrides(paths={"model_roots": roots, "input_roots": roots, "output_roots": roots})
    with console.status(f"starting the embedded stack ({worker_count} workers) ..."):
        stack = Stack(settings, worker_count=worker_count, api_port=0).start()
    try:
        console.print(f"stack up in {time.monotonic() - started:.1f}s: API {stack.api_url}, "
                      f"Redis {masked_url(stack.settings.redis.url)}")
        client = stack.client()
        _clear_earlier_results(client, demo_dir / "results")
        _register_zoo(console, client, demo_dir / "models")
        ok = _convnet_job(console, client, demo_dir, rows)
        return _verified_mlp_job(console, client, demo_dir) and ok
    finally:
        with console.status("stopping everything the demo started ..."):
            stack.stop()


def _clear_earlier_results(client: ApiClient, results_dir: Path) -> None:
    """Remove what an earlier demo in this SITS_HOME left in `results_dir` (the API refuses an output
    folder that holds a finished job's results), cancelling first any of its jobs still active (a demo
    that was interrupted)."""
    for status in ("queued", "running"):
        for job in client.get(f"/v1/jobs?status={status}")["jobs"]:
            if Path(job["output_dir"]).is_relative_to(results_dir):
                client.delete(f"/v1/jobs/{job['id']}")
    shutil.rmtree(results_dir, ignore_errors=True)


def _register_zoo(console: Console, client: ApiClient, models_dir: Path) -> None:
    paths = build_zoo(models_dir)
    for name, path in paths.items():
        mode = "full" if name == "mlp" else "static"
        record = client.post("/v1/models", {"name": name, "path": str(path), "profile_mode": mode,
                                            "enable_fusion": name == "mlp"})
        while record["profile_status"] == "pending":
            time.sleep(0.2)
            record = client.get(f"/v1/models/{record['ref']}")
        profile = record["static_profile"]
        best = max((record.get("profile") or {}).get("points", []), key=lambda p: p["rows_per_second"], default=None)
        measured = ""
        if best:
            measured = f", measured best {best['rows_per_second']:,.0f} rows/s at batch {best['batch_size']}"
        console.print(f"registered {record['ref']}: {profile['param_count']:,} params, "
                      f"{profile['flops_per_sample']:,} FLOPs/sample{measured}")


def _convnet_job(console: Console, client: ApiClient, demo_dir: Path, rows: int) -> bool:
    data = demo_dir / "data" / "pixels.npy"
    data.parent.mkdir(parents=True, exist_ok=True)
    np.save(data, np.random.default_rng(7).standard_normal((rows, 3, 32, 32)).astype(np.float32))
    console.print(f"offline job: convnet over {rows:,} images ({data})")
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(data),
                                   "output_dir": str(demo_dir / "results" / "convnet"), "chunk_size": 512,
                                   "batch_size": 64})
    final = wait_for_job(console, client, job["id"])
    if final["status"] != "succeeded":
        return False
    for output in final["manifest"]["outputs"].values():
        path = Path(final["output_dir"]) / output["file"]
        if file_checksum(path) != output["checksum"]:
            console.print(f"[red]checksum mismatch in {path}[/red]")
            return False
    console.print("output checksums re-read and verified")
    return True


def _verified_mlp_job(console: Console, client: ApiClient, demo_dir: Path) -> bool:
    features = np.random.default_rng(11).standard_normal((20_000, 64)).astype(np.float32)
    data = demo_dir / "data" / "features.npy"
    np.save(data, features)
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(data),
                                   "output_dir": str(demo_dir / "results" / "mlp"), "chunk_size": 2048})
    final = wait_for_job(console, client, job["id"], summary=False)
    logits = np.load(Path(final["output_dir"]) / "logits.npy")
    error = float(np.max(np.abs(logits - mlp_reference(features))))
    manifest = json.loads((Path(final["output_dir"]) / "manifest.json").read_text())
    good = final["status"] == "succeeded" and manifest["rows"] == len(features) and error < 1e-3
    console.print(f"check: mlp job {final['id']} ({len(features):,} rows, {final['rows_per_second']:,.0f} rows/s) "
                  f"vs a numpy forward pass of the same weights: max |diff| = {error:.2e} "
                  f"{'[green]ok[/green]' if good else '[red]MISMATCH[/red]'}")
    return good

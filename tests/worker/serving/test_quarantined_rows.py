"""Bad-row quarantine in the worker (real Redis, a real `WorkerContext`, the zoo MLP, rows failed by
`faults.fail_rows`, which raise through the real error path): bad rows are bisected out of their
mini-batch, recorded in `quarantine.jsonl` and filled; too many fail the job naming them."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs.output_layout import quarantine_part_path
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.state.store import Store
from sits_worker.serving.between_minibatches import BetweenBatches
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item, run_chunk
from sits_worker.serving.outputs import write_part
from sits_worker.serving.request_runs import run_requests, run_with_riders
from tests.leasing import lease_items
from tests.worker.worker_helpers import mlp_worker_context

FEATURES = 64
ROWS = 64


def _ctx(store: Store, zoo_dir: Path, fail_rows: list[int], max_bad_rows: int | float) -> WorkerContext:
    return mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        faults={"enabled": True, "fail_rows": fail_rows}, jobs={"max_bad_rows": max_bad_rows}))


def _job(store: Store, tmp_path: Path) -> tuple[jobs.JobSpec, np.ndarray]:
    rows = np.random.default_rng(0).standard_normal((ROWS, FEATURES), dtype=np.float32)
    np.save(tmp_path / "in.npy", rows)
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                        input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                        output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=ROWS,
                        chunk_size=16, batch_size=8)
    job_fills.create_job(store, spec, now=time.time())
    return spec, rows


def _run_job(ctx: WorkerContext, spec: jobs.JobSpec) -> dict[str, Any]:
    for _ in range(20):
        items = lease_items(ctx.store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=1)
        if not items:
            assert ctx.commits.wait(timeout=10)
            items = lease_items(ctx.store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=1)
        if not items:
            break
        process_item(ctx, items[0], BetweenBatches(ctx, items[0], ticket=""))
    assert ctx.commits.wait(timeout=10)
    return jobs.get_job(ctx.store, spec.job_id, now=time.time())


def _reference(zoo_dir: Path, rows: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(zoo_dir / "mlp.onnx"), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"features": rows[first : first + 8]})[0]
                           for first in range(0, len(rows), 8)])


def test_bad_rows_are_quarantined_and_filled_and_the_job_succeeds(store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    bad = [3, 20, 21, 50]
    ctx = _ctx(store, zoo_dir, bad, max_bad_rows=4)
    spec, rows = _job(store, tmp_path)

    job = _run_job(ctx, spec)

    assert job.status == "succeeded" and job.rows_quarantined == 4 and job.rows_done == ROWS, job
    manifest = job.manifest
    assert manifest["quarantined_rows"] == bad
    assert manifest["quarantine"] == {"file": "quarantine.jsonl", "rows": 4, "fill_values": {"logits": "NaN"}}
    entries = [json.loads(line) for line in (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert [entry["row"] for entry in entries] == bad
    assert all(f"rows [{entry['row']}] fail" in entry["error"] for entry in entries)
    logits = np.load(tmp_path / "out" / "logits.npy")
    good = np.setdiff1d(np.arange(ROWS), bad)
    np.testing.assert_allclose(logits[good], _reference(zoo_dir, rows)[good], rtol=1e-5, atol=1e-6)
    assert np.isnan(logits[bad]).all()
    assert job.retries == {} and job.failures == []  # nothing was retried: the rows were settled in the run


def test_a_chunk_run_again_writes_the_same_bytes_and_its_rows_once(store: Store, zoo_dir: Path,
                                                                    tmp_path: Path) -> None:
    ctx = _ctx(store, zoo_dir, [3, 9], max_bad_rows=0.5)
    spec, _ = _job(store, tmp_path)
    [item] = lease_items(ctx.store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=1)
    job = jobs.get_job(store, spec.job_id, now=time.time())
    out = tmp_path / "out"

    written = []
    for _ in range(2):  # as after a lost ack: the chunk runs again and its parts are written again
        results, quarantined = run_chunk(ctx, job, item, BetweenBatches(ctx, item, ticket=""))
        write_part(out, 0, results, job_id=spec.job_id, quarantined=quarantined)
        folder = out / ".parts" / spec.job_id
        written.append({path.name: path.read_bytes() for path in sorted(folder.iterdir())})

    assert written[0] == written[1] and set(written[0]) == {"logits.000000.npy", "quarantine.000000.jsonl"}
    assert [json.loads(line)["row"] for line in
            quarantine_part_path(out, 0, spec.job_id).read_text().splitlines()] == [3, 9]


def test_more_bad_rows_than_the_limit_fails_the_job_naming_them(store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    ctx = _ctx(store, zoo_dir, [3, 20, 50], max_bad_rows=2)  # at most one a chunk: found when merged
    spec, _ = _job(store, tmp_path)

    job = _run_job(ctx, spec)

    assert job.status == "failed" and job.rows_quarantined == 0, job
    assert job.error.startswith("3 rows failed, more than jobs.max_bad_rows allows (2 of this job's 64 rows): "
                                   "rows 3, 20, 50; row 3: ")
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / "logits.npy").exists()


def test_a_chunk_past_the_limit_fails_its_job_at_once(store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    ctx = _ctx(store, zoo_dir, [17, 18, 30], max_bad_rows=0.03)  # 1 of 64 rows
    spec, _ = _job(store, tmp_path)

    job = _run_job(ctx, spec)

    assert job.status == "failed" and "2 rows failed" in job.error and "rows 17, 18;" in job.error, job
    assert job.retries["bad_input"]["attempts"] == 1  # never retried
    assert math.isclose(job.failures[0]["at"], job.failures[-1]["at"])


def _submit_request(store: Store, request_id: str, value: float) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.full((1, FEATURES), value, dtype=np.float32)}, rows=1, tokens=None,
                       bucket="", factors={"level": 0}, expires_at=None)
    requests.submit_request(store, spec, score=0.0, now=time.time(), max_age_seconds=60)


def _count_runs(ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = WorkerContext.run

    def run(self: WorkerContext, model_ref: str, feed: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(next(iter(feed.values()))))
        return real(self, model_ref, feed, *args, **kwargs)

    monkeypatch.setattr(WorkerContext, "run", run)
    return sizes


def test_a_merged_batch_with_one_bad_request_is_bisected_not_run_one_by_one(
        store: Store, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(faults={"enabled": True, "fail_values": [7.5]}))
    for index in range(16):
        _submit_request(store, f"r{index}", 7.5 if index == 11 else float(index) / 16)
    items = lease_items(store, "mlp@v1", now=time.time(), lease_seconds=30, max_items=16)
    sizes = _count_runs(ctx, monkeypatch)

    assert len(items) == 16 and run_requests(ctx, items) == 15

    # The batch, then 4 levels of halves (r11 is the 4th leased: ids of equal score lease in string order);
    # a half after a clean one is split without a run of its own: 7 runs more, not 16.
    assert sizes == [16, 8, 4, 2, 1, 1, 4, 8]
    bad = requests.get_request(store, "r11")
    assert bad.status == "failed" and bad.error_code == "bad_input" and "holds 7.5" in bad.error
    assert all(requests.get_request(store, f"r{index}").status == "succeeded" for index in range(16) if index != 11)


def test_riders_are_answered_when_the_job_rows_they_ride_with_fail(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(faults={"enabled": True, "fail_values": [7.5]}))
    _submit_request(store, "rider", 0.5)
    riders = lease_items(store, "mlp@v1", now=time.time(), lease_seconds=30, max_items=1)
    feed = {"features": np.zeros((4, FEATURES), np.float32)}
    feed["features"][2, 0] = 7.5

    assert run_with_riders(ctx, "mlp@v1", feed, ["logits"], riders) is None  # the caller bisects the job's rows

    assert requests.get_request(store, "rider").status == "succeeded"
